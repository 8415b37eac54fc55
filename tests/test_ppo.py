"""ppo.py's pure functions against naive loops and hand-computed cases; whitening across 2 ranks;
the recipes (run.sh's MODEL takes `pretrained`) and the memory estimate."""

import importlib
import math
import os
import sys
import warnings

import pytest
import torch

import ppo
from batching import loss_inputs
from conftest import torchrun
from ppo import (
    POLICY_LOSSES,
    gae,
    masked_whiten,
    needs_old_logps,
    parse_args,
    policy_loss,
    token_rewards,
    value_loss,
)

HERE = os.path.dirname(os.path.abspath(__file__))


def policy_loss_of(lp, old, adv, mask, normalizer, flags=(), entropy=None):
    """policy_loss as ppo.train_micro_batch calls it: the tensors through batching.loss_inputs
    (old None: on-policy), the coefficients from ppo.py's own Args (flags: its command line)."""
    mb = {"completion_mask": mask, "old_logps": old, "advantages": adv}
    entropy = torch.zeros_like(lp) if entropy is None else entropy
    t = loss_inputs(mb, lp, entropy, "cpu")
    return policy_loss(t, parse_args([str(f) for f in flags]), normalizer)


def naive_gae(rewards, values, mask, gamma, lam):
    """Sequence by sequence in Python floats: keep the unmasked steps, run the textbook
    recursion."""
    B, C = len(rewards), len(rewards[0])
    adv = [[0.0] * C for _ in range(B)]
    for i in range(B):
        steps = [t for t in range(C) if mask[i][t]]
        last, next_v = 0.0, 0.0
        for t in reversed(steps):
            delta = rewards[i][t] + gamma * next_v - values[i][t]
            last = delta + gamma * lam * last
            next_v = values[i][t]
            adv[i][t] = last
    ret = [[(adv[i][t] + values[i][t]) if mask[i][t] else 0.0 for t in range(C)] for i in range(B)]
    return adv, ret


def random_case(B=5, C=7, seed=0, holes=False):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(B, C, generator=g, dtype=torch.float64)
    values = torch.randn(B, C, generator=g, dtype=torch.float64)
    lengths = torch.randint(0, C + 1, (B,), generator=g)
    lengths[0] = C  # one full row, and (seed 0) an empty one below
    mask = (torch.arange(C)[None] < lengths[:, None]).long()  # (B, C) right-padded completions
    if holes:  # a general mask: masked steps anywhere are skipped
        mask = (torch.rand(B, C, generator=g) > 0.3).long()
    return rewards, values, mask


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (1.0, 0.95), (0.9, 0.5), (0.99, 0.0)])
@pytest.mark.parametrize("holes", [False, True])
def test_gae_matches_naive_loop(gamma, lam, holes):
    rewards, values, mask = random_case(holes=holes)
    adv, ret = gae(rewards, values, mask, gamma, lam)
    want_adv, want_ret = naive_gae(rewards.tolist(), values.tolist(), mask.tolist(), gamma, lam)
    torch.testing.assert_close(adv, torch.tensor(want_adv, dtype=torch.float64))
    torch.testing.assert_close(ret, torch.tensor(want_ret, dtype=torch.float64))
    assert torch.all(adv[mask == 0] == 0) and torch.all(ret[mask == 0] == 0)


def test_gae_takes_a_lambda_per_sequence():
    """lam (B,): each sequence's advantages are its own row's GAE at its own lambda (a
    length-adaptive lambda, VAPO's, is one line in main)."""
    rewards, values, mask = random_case()
    lam = torch.tensor([1.0, 0.95, 0.5, 0.0, 0.8], dtype=torch.float64)  # (B,)
    adv, ret = gae(rewards, values, mask, 0.99, lam)
    for i, row_lam in enumerate(lam.tolist()):
        row = [rewards[i : i + 1].tolist(), values[i : i + 1].tolist(), mask[i : i + 1].tolist()]
        want_adv, want_ret = naive_gae(*row, 0.99, row_lam)
        torch.testing.assert_close(adv[i], torch.tensor(want_adv[0], dtype=torch.float64))
        torch.testing.assert_close(ret[i], torch.tensor(want_ret[0], dtype=torch.float64))


def test_gae_hand_computed():
    rewards = torch.tensor([[0.0, 1.0, 5.0]])
    values = torch.tensor([[0.5, 0.2, 9.0]])
    mask = torch.tensor([[1, 1, 0]])  # the third step is padding: its reward and value never count
    adv, ret = gae(rewards, values, mask, 1.0, 1.0)
    # t=1: delta = 1 + 0 - 0.2 = 0.8; t=0: delta = 0 + 0.2 - 0.5 = -0.3, A = -0.3 + 0.8 = 0.5
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.8, 0.0]]))
    # gamma = lam = 1: reward-to-go
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 0.0]]))
    adv, ret = gae(rewards, values, mask, 0.9, 0.5)
    # t=0: delta = 0.9 * 0.2 - 0.5 = -0.32, A = -0.32 + 0.45 * 0.8 = 0.04
    torch.testing.assert_close(adv, torch.tensor([[0.04, 0.8, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.54, 1.0, 0.0]]))


def test_token_rewards():
    logps = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]])
    ref = torch.tensor([[-1.5, -2.0, -2.0], [-2.0, -2.0, -2.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    rewards, kl = token_rewards(logps, ref, mask, torch.tensor([2.0, -1.0]), kl_coef=0.1)
    torch.testing.assert_close(kl, torch.tensor([[0.5, 0.0, -1.0], [1.0, 0.0, 0.0]]))
    torch.testing.assert_close(
        rewards, torch.tensor([[-0.05, 0.0, 0.1 + 2.0], [-0.1 - 1.0, 0.0, 0.0]])
    )
    # no reference
    rewards, _ = token_rewards(logps, None, mask, torch.tensor([2.0, -1.0]), kl_coef=0.1)
    torch.testing.assert_close(rewards, torch.tensor([[0.0, 0.0, 2.0], [-1.0, 0.0, 0.0]]))
    # no reference and no old log-probs (the on-policy update computes them itself)
    rewards, kl = token_rewards(None, None, mask, torch.tensor([2.0, -1.0]), kl_coef=0.0)
    torch.testing.assert_close(rewards, torch.tensor([[0.0, 0.0, 2.0], [-1.0, 0.0, 0.0]]))
    assert not kl.any()


def test_needs_old_logps():
    """The old log-prob pass is dropped only when the update is on-policy and no KL reads them."""
    on_policy = ["--kl_coef", "0", "--ppo_epochs", "1", "--num_mini_batches", "1"]
    assert not needs_old_logps(parse_args(on_policy))
    for i, value in ((1, "0.01"), (3, "2"), (5, "2")):
        assert needs_old_logps(parse_args(on_policy[:i] + [value] + on_policy[i + 1 :]))


def test_masked_whiten():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 4.0, -50.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    out = masked_whiten(x, mask)
    vals = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    want = (vals - vals.mean()) / vals.std()  # unbiased std, as TRL's masked_var
    torch.testing.assert_close(out[mask.bool()], want, atol=1e-7, rtol=1e-7)
    assert torch.all(out[:, 2] == 0)
    kept = masked_whiten(x, mask, shift_mean=False)
    torch.testing.assert_close(kept[mask.bool()], want + vals.mean(), atol=1e-7, rtol=1e-7)
    with pytest.raises(ValueError, match="at least 2"):
        masked_whiten(x, torch.tensor([[1, 0, 0], [0, 0, 0]]))


def test_masked_whiten_across_ranks(tmp_path):
    out = torchrun(os.path.join(HERE, "dist_ppo_whiten.py"), str(tmp_path), timeout=120)
    assert "whiten across ranks ok" in out.stdout


def not_graph(metrics):
    """update() reads each metric with float(): none holds the graph (float() of a tensor that
    requires grad warns, once per rank and run, as ppo.py did for its losses)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        [float(v) for v in metrics.values()]
    return not any(v.requires_grad for v in metrics.values())


def test_policy_loss_hand_computed():
    old = torch.zeros(1, 5, dtype=torch.float64)
    logps = torch.log(
        torch.tensor([[1.5, 1.5, 0.5, 0.5, 3.0]], dtype=torch.float64)
    ).requires_grad_()
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0, 7.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 0]])  # the last token is padding
    loss, m = policy_loss_of(logps, old, adv, mask, 8.0, ["--cliprange", 0.2])
    # per token: max(-1.5, -1.2) = -1.2 (clipped); max(1.5, 1.2) = 1.5; max(-0.5, -0.8) = -0.5;
    # max(0.5, 0.8) = 0.8 (clipped); the masked token never counts
    assert loss.item() == pytest.approx((-1.2 + 1.5 - 0.5 + 0.8) / 8.0)
    assert m["clip"].item() == 2 and m["tokens"].item() == 4
    assert m["ratio"].item() == pytest.approx(4.0)
    assert loss.requires_grad and not_graph(m)
    loss.backward()  # clipped tokens get no gradient; unclipped: d(-A r)/d logp = -A r
    torch.testing.assert_close(
        logps.grad, torch.tensor([[0.0, 1.5, -0.5, 0.0, 0.0]], dtype=torch.float64) / 8.0
    )


# each policy loss's naive per-token term (ratio r, advantage a, log-prob lp, cliprange eps)
NAIVE_POLICY = {
    "ppo": lambda r, a, lp, eps: torch.max(-a * r, -a * r.clamp(1 - eps, 1 + eps)),
    "cispo": lambda r, a, lp, eps: -r.clamp(max=1 + eps).detach() * a * lp,  # MiniMax-M1
}


def test_every_policy_loss_has_a_naive_reference():
    assert set(NAIVE_POLICY) == set(POLICY_LOSSES)


@pytest.mark.parametrize("loss_type", POLICY_LOSSES)
@pytest.mark.parametrize("coef", [0.0, 0.1])
def test_policy_loss_matches_naive(loss_type, coef):
    """--loss_type and --entropy_coef: loss, gradients (log-probs, entropies) and the clip count
    against a token-by-token loop; CISPO gives every unmasked token a gradient."""
    g = torch.Generator().manual_seed(2)
    logps = -torch.rand(4, 5, generator=g, dtype=torch.float64) * 3
    old = logps + (torch.rand(4, 5, generator=g, dtype=torch.float64) - 0.5) * 0.8
    adv, ent = (torch.randn(4, 5, generator=g, dtype=torch.float64) for _ in range(2))
    mask = (torch.rand(4, 5, generator=g) > 0.2).long()
    lp, en = logps.clone().requires_grad_(True), ent.clone().requires_grad_(True)
    total, clip = 0.0, 0
    for i in range(4):
        for t in range(5):
            if mask[i, t]:
                r = torch.exp(lp[i, t] - old[i, t])
                total = total + NAIVE_POLICY[loss_type](r, adv[i, t], lp[i, t], 0.2)
                total = total - coef * en[i, t]
                a = adv[i, t]  # ppo: clipped where the clip binds; cispo: where r is capped
                ppo_clip = (a > 0 and r > 1.2) or (a < 0 and r < 0.8)
                clip += bool(r > 1.2 if loss_type == "cispo" else ppo_clip)
    (total / 7.0).backward()
    want_lp, want_en = lp.grad, en.grad
    lp, en = logps.clone().requires_grad_(True), ent.clone().requires_grad_(True)
    flags = ["--cliprange", 0.2, "--loss_type", loss_type, "--entropy_coef", coef]
    loss, m = policy_loss_of(lp, old, adv, mask, 7.0, flags, entropy=en)
    loss.backward()
    assert loss.item() == pytest.approx(total.item() / 7.0, rel=1e-10)
    torch.testing.assert_close(lp.grad, want_lp)
    assert m["clip"].item() == clip > 0
    if coef:
        torch.testing.assert_close(en.grad, want_en)
    else:
        assert en.grad is None  # no bonus: the entropy's backward never runs
    if loss_type == "cispo":
        assert (lp.grad[mask == 1] != 0).all()
    args = parse_args([])
    args.loss_type = "grpo"  # past the flag's own check: policy_loss refuses it too
    with pytest.raises(ValueError, match="loss_type"):
        policy_loss(
            loss_inputs({"completion_mask": mask, "advantages": adv}, lp, en, "cpu"), args, 7.0
        )
    with pytest.raises(ppo.RunError, match="must be one of ppo"):
        parse_args(["--loss_type", "grpo"])


def test_value_loss_hand_computed():
    values = torch.tensor([[1.0, 0.6, 0.45, 5.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[0.5, 0.5, 0.5, 0.0]], dtype=torch.float64)
    returns = torch.tensor([[0.0, 1.0, 0.4, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, m = value_loss(values, old, returns, mask, clip_range_value=0.05, normalizer=3.0)
    # token 0: clip(1.0) = 0.55: max(1.0, 0.3025) = 1.0; token 1: clip(0.6) = 0.55: max(0.16,
    # 0.2025) = 0.2025 (clipped); token 2: 0.45 is inside [0.45, 0.55]: max(0.0025, 0.0025) = 0.0025
    want = 0.5 * (1.0 + 0.2025 + 0.0025) / 3.0
    assert loss.item() == pytest.approx(want)
    assert m["vf_clip"].item() == 1
    assert loss.requires_grad and not_graph(m)
    loss.backward()
    torch.testing.assert_close(
        values.grad, torch.tensor([[1.0, 0.0, 0.05, 0.0]], dtype=torch.float64) / 3.0
    )


def test_losses_add_up_over_micro_batches():
    """Micro-batch losses with the whole batch's normaliser sum to the full-batch loss."""
    g = torch.Generator().manual_seed(1)
    logps, old, adv = (torch.randn(6, 4, generator=g, dtype=torch.float64) * 0.3 for _ in range(3))
    mask = (torch.rand(6, 4, generator=g) > 0.2).long()
    n = float(mask.sum())
    full, _ = policy_loss_of(logps, old, adv, mask, n)
    parts = sum(
        policy_loss_of(logps[s], old[s], adv[s], mask[s], n)[0] for s in (slice(0, 2), slice(2, 6))
    )
    assert full.item() == pytest.approx(parts.item())
    full, _ = value_loss(logps, old, adv, mask, 0.2, n)
    parts = sum(
        value_loss(logps[s], old[s], adv[s], mask[s], 0.2, n)[0] for s in (slice(0, 3), slice(3, 6))
    )
    assert full.item() == pytest.approx(parts.item())
    assert math.isfinite(full.item())


def test_accumulation_equivalence_deepspeed(tiny_model):
    """Real DeepSpeed ZeRO-3 on 2 ranks: micro-batch x accumulation (4, 1), (1, 4), packed
    micro-batches of 2 and a 20-token budget give actor and critic the SGD update of the full
    8-sequence policy / value loss gradient; so does the on-policy update without old log-probs
    (its own forward's, ratio 1), which also hands them out for the sampler check."""
    out = torchrun(os.path.join(HERE, "dist_ppo_accum.py"), tiny_model, timeout=300)
    assert "ppo accumulation equivalence OK" in out.stdout


def test_estimate_memory_flag_counts_critic_and_reward_model(capsys, monkeypatch, tmp_path):
    """--estimate_memory for PPO: ppo.py's phases, with the trained critic (params, grads, Adam
    like the actor's) and a frozen reward model in every phase; --frozen_offload moves the
    reference and reward shards out. The critic is the policy's shape, or the reward model's with
    --critic_from_reward_model True."""
    import json

    from conftest import ROOT
    from estimate import estimate_memory
    from ppo import main
    from shapes import PRESETS, model_shape

    monkeypatch.setenv("WORLD_SIZE", "2")
    rm = tmp_path / "rm"
    rm.mkdir()
    (rm / "config.json").write_text(json.dumps(PRESETS["qwen2.5-0.5b"]))
    argv = ["--estimate_memory", "True", "--model", "qwen2.5-1.5b", "--dtype", "bf16"]
    argv += ["--ds_config", os.path.join(ROOT, "configs", "zero3.json"), "--reward_model", str(rm)]
    own = main(argv)["pieces"]["critic"]  # the critic: the policy's body + a zero value head
    q = model_shape("qwen2.5-1.5b")
    n = q["N"] - (0 if q["tied"] else q["embed_params"]) + q["H"]
    assert own == n * 2 // 2 + n * 2 // 2 + 12 * n // 2
    argv += ["--critic_from_reward_model", "True"]
    with pytest.raises(ppo.RunError, match="needs a --reward_model"):
        ppo.parse_args(["--critic_from_reward_model", "True"])
    capsys.readouterr()
    est = main(argv)
    out = capsys.readouterr().out
    assert "logprobs" in out and "update" in out and "highest phase" in out
    assert set(est["phases"]) == {"rollout", "logprobs", "update"}  # the ppo ledger's phases
    p, b, W = est["pieces"], 2, 2
    c = model_shape(str(rm))  # the critic: the reward model's body (tied: all of it) + a head
    critic_n = c["N"] + c["H"]
    assert p["critic"] == critic_n * b // W + critic_n * b // W + 12 * critic_n // W
    assert p["reward_model"] == c["N"] * b // W and p["reference"] == est["params"] * b // W
    # without the critic and reward model, every phase is lower by exactly their resident states
    bare = estimate_memory(
        "qwen2.5-1.5b",
        world_size=2,
        zero_stage=3,
        dtype="bf16",
        micro_batch_size=64,  # ppo.py's defaults
        seq_len=514,
        completion_len=2,
        num_generations=4,
        prompts_per_rank=32,
        reference_model=True,
        phase_groups=ppo.PHASES,
    )
    extra = p["critic"] + p["reward_model"]
    for phase, v in est["phases"].items():
        assert v - bare["phases"][phase] == extra, phase
    off = main(argv + ["--frozen_offload", "True"])
    assert off["pieces"]["reward_model"] == 0 and off["pieces"]["reference"] == 0
    assert off["cpu"] > est["cpu"]


def test_recipes_set_their_defaults_and_the_command_line_wins(capsys):
    """--recipe pretrained (what run.sh passes with MODEL) is RECIPES' values, through the same
    recipes.apply_recipe as grpo.py's; a flag given, in either form, wins; --help lists them."""
    import ppo

    plain = ppo.parse_args([])
    args = ppo.parse_args(["--recipe", "pretrained", "--eval_steps=7", "--learning_rate", "2e-6"])
    for name, value in ppo.recipes.PPO["pretrained"].items():
        want = {"eval_steps": 7, "learning_rate": 2e-6}.get(name, value)
        assert getattr(args, name) == want != getattr(plain, name)
    assert args.critic_learning_rate == 9e-6 and args.per_device_train_batch_size == 2
    # the memory knobs' older names are the same flags, and win over the recipe like them
    old = ["--recipe", "pretrained", "--micro_train_batch_size", "3", "--ref_offload", "True"]
    args = ppo.parse_args(old)
    assert args.per_device_train_batch_size == 3 and args.frozen_offload
    with pytest.raises(ppo.RunError, match="--recipe nope: choose one of pretrained, smollm2"):
        ppo.parse_args(["--recipe", "nope"])
    # --model and --data given: the recipe's functions (a download, a file written) never run
    args = ppo.parse_args(["--recipe", "smollm2-gsm8k", "--model", "m", "--data", "d.jsonl"])
    assert (args.model, args.data) == ("m", "d.jsonl")
    assert args.use_vllm and args.reward_funcs == "rewards:math_reward" and args.max_steps == 40
    with pytest.raises(SystemExit):
        ppo.parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the help text
    assert "pretrained: --learning_rate 1e-06, --critic_learning_rate 9e-06" in out
    assert "smollm2-gsm8k: --model smollm2.model_dir(), --data smollm2.gsm8k_train_file()" in out
    assert "smollm2-addition: --model smollm2.model_dir(), --data smollm2.addition_file()" in out
    # the addition recipe is the gsm8k one with its own data, lengths, LRs and steps
    args = ppo.parse_args(["--recipe", "smollm2-addition", "--model", "m", "--data", "d.jsonl"])
    assert args.max_completion_length == 32 and args.per_device_train_batch_size == 8
    assert args.learning_rate == args.critic_learning_rate == 1e-5 and args.max_steps == 15
    assert args.use_vllm and args.kl_coef == 0 and args.ppo_epochs == 1


def test_estimate_memory_counts_a_colocated_vllm_engine(monkeypatch):
    """--use_vllm True on CPU: the estimate holds the vLLM engine's resident set in every phase
    (the pre-flight's fit and the machine check see it, as for grpo.py); the rollout is the
    engine's instead of HF generation's."""
    from ppo import main

    monkeypatch.setenv("WORLD_SIZE", "2")
    argv = ["--estimate_memory", "True", "--max_prompt_length", "8"]
    bare, with_vllm = main(argv), main(argv + ["--use_vllm", "True"])
    engine = with_vllm["pieces"]["vllm"]
    assert bare["pieces"]["vllm"] == 0 < engine
    assert with_vllm["phases"]["rollout"] > engine
    for phase in ("logprobs", "update"):
        assert with_vllm["phases"][phase] == bare["phases"][phase] + engine, phase


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_estimate_memory_leaves_out_a_vllm_server(algo, monkeypatch):
    """--vllm_mode server: vLLM runs on devices of its own, so the trainer's ranks hold none of it
    (the machine check once counted a GPU share for it and refused every CPU server run); they
    only gather a group of weights to send it (weight_sync), and their rollout generates nothing
    (tests/test_gpu_paths.py: the resident states alone)."""
    main = importlib.import_module(algo).main
    monkeypatch.setenv("WORLD_SIZE", "2")
    argv = ["--estimate_memory", "True", "--max_prompt_length", "8"]
    bare = main(argv)
    server = main(argv + ["--use_vllm", "True", "--vllm_mode", "server"])
    sync = server["phases"].pop("weight_sync")
    rollout, bare_rollout = server["phases"].pop("rollout"), bare["phases"].pop("rollout")
    assert server["pieces"]["vllm"] == 0 and server["phases"] == bare["phases"]
    assert 0 < rollout < bare_rollout  # no HF generation on the trainer
    assert 0 < sync <= max(bare["phases"].values()) + 2**26 * 4  # states + one gathered group


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_run_sh_with_model_takes_the_loops_pretrained_recipe(algo):
    """MODEL=X bash run.sh ALGO and `bash run.sh ALGO --model X` are `ALGO.py --model X --recipe
    pretrained`: the same estimate (a preset's shape, one process, no torchrun), and not the tiny
    task's defaults' estimate, which --recipe '' keeps."""
    import subprocess

    from conftest import ROOT

    env = {k: v for k, v in os.environ.items() if k not in ("MODEL", "DATA", "NPROC", "NNODES")}
    env.update(DEVICE="cpu", NPROC="2")

    def estimate(cmd, **extra):
        done = subprocess.run(
            cmd, cwd=ROOT, env={**env, **extra}, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        return done.stdout[done.stdout.index("phase ") :]  # the table, not install.sh's or logs

    flags = ["--model", "qwen2.5-0.5b", "--estimate_memory", "True"]
    via_run_sh = estimate(["bash", "run.sh", algo] + flags[2:], MODEL="qwen2.5-0.5b")
    direct, world = (
        [sys.executable, f"{algo}.py", *flags],
        {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"},
    )
    assert via_run_sh == estimate(direct + ["--recipe", "pretrained"], **world)
    assert via_run_sh == estimate(["bash", "run.sh", algo] + flags)
    own_defaults = estimate(direct, **world)
    assert via_run_sh != own_defaults
    assert estimate(["bash", "run.sh", algo, "--recipe", ""] + flags) == own_defaults
