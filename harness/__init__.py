"""A run's management, around an algorithm's loop: the flags every script shares (flags), the steps of the shell
(shell: start, load, resume, save, close, and what the loop calls), the run's lifecycle (run), checkpoints and
--fsdp's shards (checkpoints, shards), the exported model (export), logging (logs), the held-out evaluation (evaluation),
torchrun's plumbing (distributed), and the inputs: prompt files (prompt_files) and DPO's pairs (pair_files)."""
