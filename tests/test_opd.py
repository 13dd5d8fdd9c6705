"""DiffusionOPD: the per-step KL against torch.distributions and a closed form in the velocities, the teachers' routing and
prompts by hand, a teacher loaded from an export against the stock pipeline's own loading, a teacher equal to the
student (nothing to learn: KL 0, nothing moves), and the student learning its teacher on held-out prompts."""

import json
from pathlib import Path

import pytest
import torch
from conftest import run_script, scalars

import common
import models
from algos import opd

REPO = Path(__file__).resolve().parents[1]
TEACHER = REPO / "assets" / "opd" / "teachers" / "attr"  # CRD on the colour-attribution prompts
TINY = "--num-prompts 2 --group-size 4 --micro-batch 4 --num-steps 4 --grad-steps-per-epoch 1".split()


def test_step_kl_is_the_gaussian_kl_of_two_steps_with_one_std():
    g = torch.Generator().manual_seed(0)
    mu_s, mu_t = torch.randn(3, 4, 2, 2, generator=g), torch.randn(3, 4, 2, 2, generator=g)
    for std in (torch.tensor(0.3), torch.tensor([0.1, 0.5, 2.0])):
        scale = std.view(-1, 1, 1, 1).expand_as(mu_s)
        expected = torch.distributions.kl_divergence(
            torch.distributions.Normal(mu_s, scale), torch.distributions.Normal(mu_t, scale)
        )
        torch.testing.assert_close(opd.step_kl(mu_s, mu_t, std), expected.flatten(1).mean(1))
        torch.testing.assert_close(opd.step_kl(mu_t, mu_s, std), opd.step_kl(mu_s, mu_t, std))  # symmetric


def test_step_kl_in_velocities_ode_and_flow_sde():
    """Through the sampler's own step: ODE (std 0, the authors' numerator) gives dt^2 ||v_s - v_t||^2 / 2; Flow-SDE gives
    the Gaussian KL with the mean's velocity coefficient dt (1 + s^2 (1 - sigma) / (2 sigma)), s = eta sqrt(sigma /
    (1 - sigma)), and std s sqrt(-dt), written out here in float64 scalars."""
    g = torch.Generator().manual_seed(1)
    x, v_s, v_t = (torch.randn(2, 4, 3, 3, generator=g, dtype=torch.float64) for _ in range(3))
    sigma, sigma_next, eta = 0.6, 0.45, 0.7
    dv2 = (v_s - v_t).pow(2).flatten(1).mean(1)
    dt = sigma_next - sigma
    _, _, m_s, std = common.sde_step(x, v_s, sigma, sigma_next, "ODE", eta)
    _, _, m_t, _ = common.sde_step(x, v_t, sigma, sigma_next, "ODE", eta)
    torch.testing.assert_close(opd.step_kl(m_s, m_t, std), dt**2 * dv2 / 2)
    _, _, m_s, std = common.sde_step(x.float(), v_s.float(), sigma, sigma_next, "Flow-SDE", eta, sigma_cap=0.9)
    _, _, m_t, _ = common.sde_step(x.float(), v_t.float(), sigma, sigma_next, "Flow-SDE", eta, sigma_cap=0.9)
    s2 = eta**2 * sigma / (1 - sigma)
    expected = (dt * (1 + s2 * (1 - sigma) / (2 * sigma))) ** 2 * dv2 / (2 * s2 * -dt)
    torch.testing.assert_close(opd.step_kl(m_s, m_t, std).double(), expected, rtol=1e-5, atol=0)


def test_step_kl_gradient_flows_through_the_student_mean_only():
    mu_s = torch.tensor([[1.0, 2.0]], requires_grad=True)
    mu_t = torch.tensor([[0.5, 3.0]], requires_grad=True)
    opd.step_kl(mu_s, mu_t.detach(), torch.tensor(0.5)).sum().backward()
    # d/d mu_s of mean((mu_s - mu_t)^2) / (2 std^2) = (mu_s - mu_t) / (std^2 D), D = 2 elements
    torch.testing.assert_close(mu_s.grad, torch.tensor([[0.5, -1.0]]) / (0.25 * 2))
    assert mu_t.grad is None


def test_teachers_take_alternate_groups_by_global_index():
    assert opd.teacher_of(range(16), 4, 2).tolist() == [0] * 4 + [1] * 4 + [0] * 4 + [1] * 4
    assert opd.teacher_of(range(6), 2, 3).tolist() == [0, 0, 1, 1, 2, 2]
    assert opd.teacher_of([4, 5, 12], 4, 2).tolist() == [1, 1, 1]  # a rank's slice routes as one process does


def test_each_group_is_drawn_from_its_teachers_prompts():
    sets = [[f"a{i}" for i in range(5)], [f"b{i}" for i in range(3)]]
    prompts = opd.draw_prompts(sets, 5, 3, torch.Generator().manual_seed(0))
    groups = [prompts[i : i + 3] for i in range(0, 15, 3)]
    assert all(len(set(gr)) == 1 for gr in groups)
    assert [gr[0][0] for gr in groups] == ["a", "b", "a", "b", "a"]
    assert len({gr[0] for gr in groups[::2]}) == 3  # without replacement within a teacher's draw
    # one teacher: the other scripts' draw, the same prompts for the same generator state
    one = opd.draw_prompts([sets[0]], 4, 2, torch.Generator().manual_seed(3))
    assert one == common.group_prompts(sets[0], 4, 2, torch.Generator().manual_seed(3))


def test_teacher_export_finds_the_weights_or_says_what_is_missing(tmp_path):
    (tmp_path / "run" / "lora").mkdir(parents=True)
    assert opd.teacher_export(tmp_path / "run") == ("lora", tmp_path / "run" / "lora")
    assert opd.teacher_export(tmp_path / "run" / "lora") == ("lora", tmp_path / "run" / "lora")
    assert opd.teacher_export(common.TINY_MODEL)[0] == "transformer"  # a pipeline folder: its transformer
    with pytest.raises(common.UserError, match="no transformer/ or lora/ export"):
        opd.teacher_export(tmp_path)


def velocity_on(transformer, seed=0):
    pipe = models.load_pipeline(common.TINY_MODEL, torch.device("cpu"))
    cond = common.PromptEncoder(pipe).cond(["a red circle", "two squares"])
    x = torch.randn(2, *pipe.latent_shape, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return common.velocity(transformer or pipe.transformer, x, 0.7, cond, 1.0)


@pytest.mark.slow
def test_a_lora_teacher_is_fused_as_the_stock_pipeline_loads_it(tmp_path):
    """A LoRA export (random B, so that it changes the model) loaded by `load_teacher` (fused) gives the velocity of the
    stock pipeline with `load_lora_weights` (unfused); a full export gives its transformer's; a LoRA that does not fit
    --model is one UserError."""
    from peft import LoraConfig, get_peft_model_state_dict

    pipe = models.load_pipeline(common.TINY_MODEL, torch.device("cpu"))
    pipe.transformer.add_adapter(LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian", target_modules=["to_q", "to_v"]))
    torch.manual_seed(0)
    for n, p in pipe.transformer.named_parameters():
        if "lora_B" in n:
            p.data.normal_(0, 0.05)
    (tmp_path / "t" / "lora").mkdir(parents=True)
    type(pipe.pipe).save_lora_weights(
        tmp_path / "t" / "lora", transformer_lora_layers=get_peft_model_state_dict(pipe.transformer)
    )
    args = opd.Args(model=common.TINY_MODEL)
    teacher = opd.load_teacher(args, opd.teacher_export(tmp_path / "t"), torch.device("cpu"))
    stock = models.load_pipeline(common.TINY_MODEL, torch.device("cpu"))
    stock.pipe.load_lora_weights(str(tmp_path / "t" / "lora"))
    torch.testing.assert_close(velocity_on(teacher), velocity_on(stock.transformer), rtol=1e-5, atol=1e-5)
    assert (velocity_on(teacher) - velocity_on(None)).abs().max() > 1e-3  # the LoRA changed the model
    assert not any(p.requires_grad for p in teacher.parameters())

    full = opd.load_teacher(args, opd.teacher_export(TEACHER), torch.device("cpu"))
    trained = type(stock.transformer).from_pretrained(TEACHER / "transformer")
    torch.testing.assert_close(velocity_on(full), velocity_on(trained), rtol=0, atol=0)

    bad = opd.Args(model=str(REPO / "assets" / "tiny-shapes-8"))  # 8 layers: the LoRA's 4-layer keys do not fit
    with pytest.raises(common.UserError, match="does not load into --model"):
        opd.load_teacher(bad, opd.teacher_export(TEACHER), torch.device("cpu"))


def test_the_defaults_are_the_committed_demo_teachers_and_their_prompts():
    """`python algos/opd.py` distils the two committed tiny-shapes teachers, each from its own prompt domain (the
    split of assets/train.jsonl by kind); other --teachers take --train-prompts unless --teacher-prompts says."""
    for teacher in opd.TEACHERS:
        assert opd.teacher_export(teacher)[0] == "transformer"
    lines = [json.loads(line) for line in (REPO / "assets" / "train.jsonl").read_text().splitlines()]
    attr, rest = ([json.loads(line) for line in Path(p).read_text().splitlines()] for p in opd.TEACHER_PROMPTS)
    assert attr == [x for x in lines if x["category"] == "color_attr"] and rest == [
        x for x in lines if x["category"] != "color_attr"
    ]
    for d, teacher in zip(("attr", "rest"), opd.TEACHERS):
        assert json.loads((Path(teacher) / "args.json").read_text())["train_prompts"] == f"assets/opd/{d}_train.jsonl"


@pytest.mark.slow
def test_a_teacher_equal_to_the_student_teaches_nothing(tmp_path):
    """The base pipeline as the teacher of a LoRA student (B = 0: the student is the base): every step's KL is exactly
    0, so is every gradient, and the LoRA's B stays 0 (AdamW's decay only shrinks A)."""
    out = tmp_path / "runs"
    run_script(
        ["algos/opd.py", *TINY, "--no-full-finetune", "--teachers", common.TINY_MODEL, "--num-epochs", "2"]
        + ["--eval-every", "10", "--output-dir", out]
    )
    (run_dir,) = out.iterdir()
    s = scalars(run_dir)
    assert s["losses/policy_loss"] == [0.0, 0.0] and s["charts/kl_teacher0"] == [0.0, 0.0]
    from harness.checkpoints import load_checkpoint

    params = load_checkpoint(run_dir)["params"]
    assert all(v.abs().max() == 0 for k, v in params.items() if "lora_B" in k)


@pytest.mark.slow
def test_the_student_learns_its_teacher_on_held_out_prompts(tmp_path):
    """8 epochs of distillation from a CRD-trained teacher: the student's velocity on held-out prompts (at states on
    the teacher's own samples, which the student never trained on) moves towards the teacher's: the mean squared gap
    falls by more than a third. A sign error in the loss or a teacher that is not used makes it grow or stay."""
    out = tmp_path / "runs"
    flags = [*TINY, "--num-prompts", "4", "--micro-batch", "8", "--num-train-timesteps", "3", "--num-epochs", "8"]
    run_script(["algos/opd.py", *flags, "--teachers", TEACHER, "--eval-every", "100", "--output-dir", out])
    (run_dir,) = out.iterdir()
    assert json.loads((run_dir / "args.json").read_text())["full_finetune"] is True
    pipe = models.load_pipeline(common.TINY_MODEL, torch.device("cpu"))
    teacher = type(pipe.transformer).from_pretrained(TEACHER / "transformer")
    student = type(pipe.transformer).from_pretrained(run_dir / "transformer")
    encoder = common.PromptEncoder(pipe)
    prompts = [json.loads(line)["prompt"] for line in (REPO / "assets" / "test.jsonl").read_text().splitlines()]
    cond = encoder.cond(prompts)
    gen = common.keyed_generators(7, 0, "test", indices=range(len(prompts)))
    x0 = common.sample(teacher, pipe.scheduler, cond, num_steps=10, generator=gen, latent_shape=pipe.latent_shape).latents
    gaps = {}
    for name, model in (("base", pipe.transformer), ("student", student)):
        total = 0.0
        for sigma in (0.9, 0.6, 0.3):
            eps = torch.randn(x0.shape, generator=torch.Generator().manual_seed(int(sigma * 10)))
            xt = (1 - sigma) * x0 + sigma * eps
            with torch.no_grad():
                total += (
                    (common.velocity(model, xt, sigma, cond) - common.velocity(teacher, xt, sigma, cond)).pow(2).mean().item()
                )
        gaps[name] = total
    assert gaps["student"] < 0.67 * gaps["base"], gaps
    kl = scalars(run_dir)["losses/policy_loss"]
    assert sum(kl[-3:]) < sum(kl[:3]), kl
