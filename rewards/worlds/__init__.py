"""The tiny testbeds' worlds: what a scene holds and how it is captioned (shapes.py: tiny-shapes; text.py: tiny-text;
edit.py: tiny-edit's instructions), the ground truth the programmatic rewards score against and the builders in
benchmark/testbeds/ render from."""
