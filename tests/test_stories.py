"""stories.py, the pretrained-model example: its reward on hand-written completions (the judge is
the real stories260K model from ../shared/assets), and `python stories.py` for 2 steps end to
end."""

import json
import os
import subprocess
import sys

import pytest

import stories
from conftest import ROOT, free_port

needs_model = pytest.mark.skipif(
    not os.path.isdir(stories.MODEL),
    reason=(
        f"needs the stories260K model at {stories.MODEL} (../shared/assets beside the checkout)"
    ),
)
PROMPT = "One day, a boy named Tom went to the park. He"


def test_prompts_are_unique_story_openings():
    rows = stories.prompts()
    assert len(rows) == 324 == len({r["prompt"] for r in rows})
    assert all(set(r) == {"prompt"} for r in rows)


def test_mentions_and_novelty():
    comps = ["saw a dog.", "saw two dogs!", "saw a doghouse and a hotdog.", "Dog ran.", ""]
    assert stories.mentions_dog(None, comps, None) == [1.0, 1.0, 0.0, 1.0, 0.0]
    assert stories.novelty(
        None, ["the dog was happy. the dog was happy.", "a b c d", "hi"], None
    ) == [1 - 2 / 6, 1.0, 1.0]  # 6 trigrams, the last 2 repeat the first 2


@needs_model
def test_the_reward_prefers_a_fluent_varied_dog_story():
    comps = [
        "saw a big dog in the park. The dog was brown and friendly. Tom wanted to play with it.",
        "saw a dog. The dog was happy. The dog was happy. The dog was happy. The dog was happy.",
        "dog dog dog dog dog dog dog dog dog dog",
        "saw a big cat in the park. The cat was brown and friendly. Tom wanted to play with it.",
        "",
    ]
    fluency = stories.fluency([PROMPT] * 5, comps, None)
    assert fluency[0] > 0.9 and fluency[2] == 0.0 and fluency[4] == 0.0  # -0.9 nats; -3.3; empty
    r = stories.reward([PROMPT] * 5, comps, None)
    assert r[0] > 0.9 and r[0] > 2 * r[1] and r[2] == 0.0 and r[3] == 0.0 and r[4] == 0.0


@needs_model
def test_python_stories_py_two_steps(tmp_path):
    env = {
        **os.environ,
        "RUN_DIR": str(tmp_path / "run"),
        "NPROC": "2",
        "OMP_NUM_THREADS": "1",
        "MASTER_PORT": str(free_port()),
    }
    proc = subprocess.run(
        [
            sys.executable,
            "stories.py",
            "--max_steps",
            "2",
            "--eval_steps",
            "0",
            "--num_eval_prompts",
            "8",
            "--prompts_per_rank",
            "2",
            "--save_model",
            "False",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    train = [r for r in rows if "reward" in r]
    assert [r["step"] for r in train] == [1, 2]
    for part in ("mentions_dog", "fluency", "novelty"):
        assert 0 <= train[0][f"rewards/{part}/mean"] <= 1
    assert "held-out reward: start" in proc.stdout
