"""Load-time self-check of the target actually loaded, and the verify mode it decides (tree / chain / plain / refused).

A list of supported families cannot keep the runtime's promise (exact output or a clear refusal); a check
of the model as it will run can. On a short random prefix, in the model's dtype and attention
implementation, `check_mode` compares our forwards with the model's own causal forward (no cache, no custom
mask) over the same tokens:

- tree:  a tree with several branches (depth 3) forwarded in ONE call with the tree mask == per-path causal
         forwards (batched into one forward), node by node; then an accepted path that is not the first nodes is committed (the one
         compaction routine moves slots) and the next forward == the causal forward of the kept sequence, and
         the compacted cache == the cache of a sequential prefill of that sequence;
- chain: the same through the model's own causal path (2D mask, rollback by cropping the cache);
- plain: one token per forward, nothing rolled back.

Tolerance: max |ours - causal| / max(1, max |causal|) <= TOLERANCE[dtype] (fp64 1e-6: HF eager softmaxes in
fp32; fp32 1e-4; bf16/fp16 5e-2). A mask the model ignores or a cache that was not compacted gives errors
of order 1.

`choose_mode` tries trees on the loaded attention implementation, then on the other one (sdpa <-> eager),
then chains, then plain decoding; a model with recurrent layers (state that cannot be rolled back) or none
that pass is refused. `prepare_target` is the one call the CLIs make: it caches the result per (model
path or Hub id, weights fingerprint or revision, dtype, attention implementation, device, library
versions) under $SPECHEADS_CACHE/verify_check (~/.cache/specheads), prints one line, and returns a
`TargetModel` in the chosen mode, or raises `TargetError` (one line, exit code 2 from the CLIs).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import transformers
from transformers import PreTrainedModel

from heads import cache
from heads.files import atomic_write_json
from heads.loading import dtype_name
from runtime.layout import check_layout, choose_layout
from runtime.lean import lean_unavailable
from runtime.target import SUPPORTED_ATTENTION, TargetError, TargetModel
from runtime.tree import Tree

CHECK_VERSION = 1  # bump when the check changes: cached results of older checks are ignored
TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 5e-2}
PREFIX_LENGTH = 7
CHECK_TREE = [-1, 0, 0, 0, 1, 1, 2, 4]  # three branches at the root, depth 3; leaves 3, 5, 6, 7
CHECK_KEEP = [0, 2, 6]  # an accepted path that is not the first nodes: compaction must move slots
_ATTENTION_LAYERS = {"full_attention", "sliding_attention"}


class CheckFailed(Exception):
    """One check did not pass; the message says where (internal to this module)."""


@dataclass(frozen=True)
class CheckResult:
    """What the self-check decided for one loaded model."""

    mode: str  # "tree", "chain", "plain" or "refused"
    attn_implementation: str  # the attention implementation the model runs with (may differ from the loaded one)
    dtype: str
    reason: str = ""  # why not trees (or why refused); "" when trees pass
    max_error: float = 0.0  # relative error of the check that passed
    seconds: float = 0.0  # time the check took when it ran
    cached: bool = False

    def line(self) -> str:
        """The one line printed at startup, e.g. 'verify check: trees ok (sdpa, float32), 0.42 s'."""
        where = f"({self.attn_implementation}, {self.dtype})"
        cost = "cached" if self.cached else f"{self.seconds:.2f} s"
        if self.mode == "tree":
            return f"verify check: trees ok {where}, {cost}"
        if self.mode == "chain":
            return f"verify check: chains only {where}, {cost}; tree methods draft chains because {self.reason}"
        if self.mode == "plain":
            return f"verify check: plain decoding only {where}, {cost}; speculation off because {self.reason}"
        return f"verify check: refused {where}: {self.reason}"


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.double()
    return float((got.double() - want).abs().max() / max(1.0, float(want.abs().max())))


def _causal_logits(model: PreTrainedModel, sequences: list[list[int]]) -> list[torch.Tensor]:
    """The model's own causal forward over each sequence (no cache, no custom mask), all in ONE batch: logits
    [T_i, V] float per sequence. Right padding is harmless under a causal mask (no real token sees it)."""
    length = max(len(ids) for ids in sequences)
    tokens = torch.tensor([ids + [ids[-1]] * (length - len(ids)) for ids in sequences], device=model.device)
    with torch.inference_mode():
        out = model(input_ids=tokens, attention_mask=torch.ones_like(tokens), use_cache=False)
    return [out.logits[i, :len(ids)].float() for i, ids in enumerate(sequences)]


def _compare(label: str, got: torch.Tensor, want: torch.Tensor, tolerance: float) -> float:
    if got.shape != want.shape:
        raise CheckFailed(f"{label}: shape {tuple(got.shape)} vs {tuple(want.shape)} of the causal forward")
    error = _error(got.float(), want)
    if not error <= tolerance:  # also catches NaN
        raise CheckFailed(f"{label} differs from the model's causal forward (relative error {error:.2g} > "
                          f"{tolerance:g})")
    return error


def _compare_caches(label: str, got, want, tolerance: float) -> None:
    """Compacted cache == sequential cache, layer by layer (skipped for caches without key/value layers)."""
    layers = getattr(got, "layers", None)
    if layers is None or not all(hasattr(layer, "keys") for layer in layers):
        return
    for i, (a, b) in enumerate(zip(layers, want.layers, strict=True)):
        for kind in ("keys", "values"):
            x, y = getattr(a, kind), getattr(b, kind)
            if x is None or y is None:
                continue
            _compare(f"{label}: layer {i} {kind}", x, y.float(), tolerance)


def check_mode(model: PreTrainedModel, mode: str, seed: int = 0) -> float:
    """Run the self-check of `mode` on `model` as loaded; returns the largest relative error.

    Raises CheckFailed (message: which forward and how far off) when ours and the causal forward differ
    beyond TOLERANCE, or when the model raises.
    """
    tolerance = TOLERANCE.get(model.dtype, 5e-2)
    vocab = int(model.get_input_embeddings().weight.shape[0])
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(vocab, (PREFIX_LENGTH,), generator=gen).tolist()
    parents = CHECK_TREE if mode == "tree" else ([-1, 0, 1, 2, 3] if mode == "chain" else [-1])
    keep = CHECK_KEEP if mode == "tree" else list(range(min(2, len(parents))))
    tree = Tree.from_parents(parents)
    tokens = torch.randint(vocab, (tree.num_nodes,), generator=gen)
    after = torch.randint(vocab, (2 if mode != "plain" else 1,), generator=gen)  # the next forward after commit
    paths = tree.paths()
    kept = prefix + tokens[keep].tolist()
    try:
        references = _causal_logits(model, [prefix + tokens[path].tolist() for path in paths]
                                    + [kept + after.tolist()])
        target = TargetModel(model, mode=mode)
        worst = _compare("prefill", target.prefill(torch.tensor(prefix)).logits[-1],
                         references[0][PREFIX_LENGTH - 1], tolerance)
        out = target.forward(tokens.to(target.device), tree).logits  # [N, V]
        for path, want in zip(paths, references, strict=False):
            worst = max(worst, _compare(f"{mode} forward, path {path}", out[path], want[PREFIX_LENGTH:], tolerance))
        target.commit(keep)
        if mode != "plain":
            sequential = TargetModel(model, mode="chain" if mode != "tree" else "tree")
            sequential.prefill(torch.tensor(kept))
            _compare_caches(f"compacted cache (kept nodes {keep})", target.cache, sequential.cache, tolerance)
        out = target.forward(after.to(target.device), Tree.chain(after.numel() - 1)).logits
        worst = max(worst, _compare(f"forward after committing nodes {keep}", out, references[-1][len(kept):],
                                    tolerance))
    except CheckFailed:
        raise
    except Exception as error:  # the model raised: the mode does not work for it, say where
        cause = error.__cause__ if isinstance(error, TargetError) and error.__cause__ else error
        text = str(cause).strip().splitlines()[0] if str(cause).strip() else "(no message)"
        raise CheckFailed(f"{type(cause).__name__}: {text}") from error
    return worst


def rollback_blocker(model: PreTrainedModel) -> str | None:
    """Why rejected draft tokens cannot be dropped from this model's state (None when they can)."""
    layer_types = getattr(model.config.get_text_config(), "layer_types", None) or []
    recurrent = sorted(set(layer_types) - _ATTENTION_LAYERS)
    if recurrent:
        return (f"layers {recurrent} keep a recurrent state that cannot be rolled back to drop rejected draft "
                f"tokens")
    return None


def _set_attention(model: PreTrainedModel, implementation: str) -> bool:
    """Switch the model's attention implementation in place; False when the model does not support it."""
    if getattr(model.config, "_attn_implementation", None) == implementation:
        return True
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # families without the switch only log that they ignore it
    try:
        model.set_attn_implementation(implementation)
    except (ValueError, ImportError, NotImplementedError):
        return False
    finally:
        transformers.logging.set_verbosity(verbosity)
    return getattr(model.config, "_attn_implementation", None) == implementation


def choose_mode(model: PreTrainedModel) -> CheckResult:
    """Decide the verify mode by running the checks in order (see module docstring); may switch the model's
    attention implementation (sdpa <-> eager) when trees only pass on the other one."""
    start = time.perf_counter()
    loaded = getattr(model.config, "_attn_implementation", None) or "eager"
    dtype = dtype_name(model.dtype)

    def result(mode: str, reason: str = "", error: float = 0.0) -> CheckResult:
        return CheckResult(mode, model.config._attn_implementation, dtype, reason, error, time.perf_counter() - start)

    failures: dict[str, list[str]] = {}  # message -> the checks that failed with it

    def failed(label: str, failure: CheckFailed) -> None:
        failures.setdefault(str(failure)[:200], []).append(label)

    def reasons() -> str:
        return "; ".join(f"{', '.join(labels)}: {message}" for message, labels in failures.items())

    blocker = rollback_blocker(model)
    if blocker is None:
        for implementation in [loaded] + [a for a in SUPPORTED_ATTENTION if a != loaded]:
            if not _set_attention(model, implementation):
                continue
            try:
                return result("tree", "", check_mode(model, "tree"))
            except CheckFailed as failure:
                failed(f"trees on {implementation}", failure)
        if not _set_attention(model, loaded):
            raise TargetError(f"{type(model).__name__}: cannot switch attention back to {loaded}")
        try:
            return result("chain", reasons(), check_mode(model, "chain"))
        except CheckFailed as failure:
            failed(f"chains on {loaded}", failure)
    try:
        return result("plain", blocker or reasons(), check_mode(model, "plain"))
    except CheckFailed as failure:
        failed(f"plain decoding on {loaded}", failure)
    return result("refused", blocker or reasons())


def check_key(model: PreTrainedModel) -> dict[str, str] | None:
    """What identifies a check result on disk; None for a model built in memory (never cached)."""
    name = getattr(model.config, "_name_or_path", "") or ""
    if not name:
        return None
    path = Path(name)
    if path.is_dir():  # local weights: fingerprint by file name, size and mtime (hashing GBs would cost seconds)
        files = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".bin", ".pt", ".json"))
        weights = hashlib.sha256(str([(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files])
                                 .encode()).hexdigest()[:16]
        name = str(path.resolve())
    else:
        weights = getattr(model.config, "_commit_hash", None) or ""
        if not weights:
            return None  # a Hub id without a resolved revision: nothing stable to key on
    return {"model": name, "weights": weights, "dtype": str(model.dtype),
            "attn_implementation": str(getattr(model.config, "_attn_implementation", None)),
            "device": model.device.type, "transformers": transformers.__version__, "torch": torch.__version__,
            "check_version": str(CHECK_VERSION)}


def _cache_file(key: dict[str, str]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return cache.entry("verify_check", f"{digest}.json")


def verify_check(model: PreTrainedModel, use_cache: bool = True) -> CheckResult:
    """The check result for `model` (from the on-disk cache when this exact model was checked before: one process
    checks, others started with it wait and read its result); leaves the model on the attention implementation the
    result names."""
    key = check_key(model) if use_cache else None
    if key is None:
        return choose_mode(model)
    fresh: list[CheckResult] = []

    def check() -> dict:
        fresh.append(choose_mode(model))
        return {"key": key, "result": asdict(fresh[0])}

    def cached(record) -> CheckResult | None:
        try:
            return CheckResult(**{**record["result"], "cached": True}) if record.get("key") == key else None
        except (TypeError, KeyError, AttributeError):
            return None

    record = cache.cached_json(_cache_file(key), check, valid=lambda record: cached(record) is not None)
    if fresh:
        return fresh[0]
    result = cached(record)
    if _set_attention(model, result.attn_implementation):
        return result
    result = choose_mode(model)  # the cached implementation cannot be set on this model: check it again
    atomic_write_json(_cache_file(key), {"key": key, "result": asdict(result)}, indent=1)
    return result


STEPS_PROBE = 16  # tokens of the verify compared with one-token steps (sdpa's reduction order changes from 4+ rows)


def _probe_forwards(target: TargetModel, tokens: int, seed: int, with_hidden: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """After a random prefix (from `seed`): `tokens` random tokens fed one at a time, then the same tokens verified as
    one chain: (the steps' logits [tokens, V], their last hidden states [tokens, H] when asked, the verify's logits).
    Leaves the target with a cache to be replaced by the next prefill."""
    vocab = target.vocab_size
    gen = torch.Generator().manual_seed(seed)
    prefix, chain = torch.randint(vocab, (PREFIX_LENGTH,), generator=gen), torch.randint(vocab, (tokens,), generator=gen)
    indices = (-1,) if with_hidden else ()
    target.prefill(prefix)
    steps, hidden = [], []
    for token in chain:
        out = target.forward(token[None].to(target.device), Tree.chain(0), hidden_state_indices=indices)
        steps.append(out.logits[0])
        if with_hidden:
            hidden.append(out.hidden[-1][0])
        target.commit([0])
    target.prefill(prefix)
    verified = target.forward(chain.to(target.device), Tree.chain(tokens - 1)).logits
    target.commit([])
    return torch.stack(steps), torch.stack(hidden) if with_hidden else None, verified


def verify_equals_steps(target: TargetModel, tokens: int = STEPS_PROBE, seed: int = 0) -> bool:
    """Whether a verify of `tokens` tokens (a chain) gives the same logits, bit for bit, as feeding them one at a
    time: the property that makes speculative output equal plain decoding's in a reduced dtype (runtime.kernels:
    batch-invariant Linear and attention). Leaves the target with a cache to be replaced by the next prefill."""
    steps, _, verified = _probe_forwards(target, tokens, seed)
    return torch.equal(verified, steps)


def _cached_probe(target: TargetModel, layout: str, probe: str, field: str, compute, use_cache: bool):
    """`compute()` for this model, dtype and layout, from the verify check's on-disk cache (keyed with `probe`) or run
    and cached there; run uncached for a model built in memory or use_cache=False."""
    key = check_key(target.model) if use_cache else None
    if key is None:
        return compute()
    key = {**key, "layout": layout, "probe": probe}
    record = cache.cached_json(_cache_file(key), lambda: {"key": key, field: compute()},
                               valid=lambda record: record.get("key") == key and field in record)
    return record[field]


def steps_line(target: TargetModel, layout: str, use_cache: bool = True) -> str:
    """The verify check's second line for a reduced dtype (cached with the check): whether verifying equals one-token
    steps bit for bit on this model, dtype and weight layout."""
    equal = bool(_cached_probe(target, layout, f"steps{STEPS_PROBE}", "equal", lambda: verify_equals_steps(target),
                               use_cache))
    where = f"({dtype_name(target.dtype)}, {layout})"
    if equal:
        return (f"verify check: a {STEPS_PROBE}-token verify == {STEPS_PROBE} one-token steps bit for bit {where}: "
                f"speculative output is plain decoding's")
    return (f"verify check: a {STEPS_PROBE}-token verify differs from one-token steps in the last bits {where}: "
            f"near-ties of the two best logits can flip; --exact decodes in float32")


LEAN_ENV = "SPECHEADS_LEAN"  # "off": decode steps and verifies keep transformers' forward (A/B measurements)


def _lean_off_by_env() -> bool:
    return os.environ.get(LEAN_ENV, "").strip().lower() in ("off", "0", "false", "no")


def _reference_and_lean(target: TargetModel, attention: str, tokens: int, seed: int
                        ) -> tuple[tuple, tuple | Exception]:
    """The same probe (`_probe_forwards`, hidden states too) through transformers' forward and through the lean
    forward with `attention` (or what the lean forward raised); the target's lean settings restored after."""
    wanted = (target.lean_wanted, target.lean_attention)
    try:
        target.lean_wanted = False
        reference = _probe_forwards(target, tokens, seed, with_hidden=True)
        target.lean_wanted, target.lean_attention = True, attention
        try:
            lean = _probe_forwards(target, tokens, seed, with_hidden=True)
        except Exception as error:
            lean = error
    finally:
        target.lean_wanted, target.lean_attention = wanted
    return reference, lean


def lean_matches(target: TargetModel, attention: str = "rows", tokens: int = STEPS_PROBE, seed: int = 1) -> str:
    """'' when the lean forward (runtime.lean) with `attention` gives transformers' forward's logits and last hidden
    states bit for bit on `tokens` one-token steps after a random prefix (plain decoding is unchanged) and its
    `tokens`-token verify gives, bit for bit, for "rows" (bf16: the row kernel) its own one-token steps' logits
    (speculation is lossless on it), for "model" (float32: the model's own attention function) transformers' verify
    logits (float32 decoding on it is the same numbers, only faster); else what differed, or that it raised."""
    reference, lean = _reference_and_lean(target, attention, tokens, seed)
    if isinstance(lean, Exception):  # an attention function that does not take our call: transformers' forward stays
        return f"forward failed ({type(lean).__name__}: {str(lean).splitlines()[0] if str(lean) else ''})"
    for label, got, want in zip(("step logits", "step hidden states"), lean, reference, strict=False):
        if not torch.equal(got, want):
            return f"{label} differ from transformers' forward"
    if attention == "rows" and not torch.equal(lean[2], lean[0]):
        return "verify logits differ from its own one-token steps"
    if attention == "model" and not torch.equal(lean[2], reference[2]):
        return "verify logits differ from transformers' forward"
    return ""


def lean_line(target: TargetModel, layout: str, use_cache: bool = True) -> str:
    """Turn the lean forward on where it serves this target and matches transformers' forward bit for bit
    (`lean_matches`, cached with the check): bf16 with the row kernel, float32 with the model's own attention
    function; the one line saying so, or why not ('' when the model is not one it serves). What float32 saves is the
    model's machinery around the same ops: a torch.cat of every layer's whole cache per step (keys and values are
    written in place), mask preparation, module calls, three products where one does; measured on SmolLM2-135M
    (float32, one thread, transposed+panels, KV 256) 1.18x a plain step and 1.16-1.21x a verify of 2-5 tokens."""
    float32 = target.dtype == torch.float32
    attention = "model" if float32 else "rows"
    if target.mode != "tree" or lean_unavailable(target.model, float32, attention):
        return ""
    if _lean_off_by_env():
        return f"verify check: lean forward off (${LEAN_ENV}); decode steps run transformers' forward"
    probe = f"lean_model{STEPS_PROBE}" if float32 else f"lean{STEPS_PROBE}"
    difference = str(_cached_probe(target, layout, probe, "difference", lambda: lean_matches(target, attention),
                                   use_cache))
    where = f"({dtype_name(target.dtype)}, {layout})"
    if difference:
        return f"verify check: lean forward off {where}: its {difference}; decode steps run transformers' forward"
    target.lean_wanted, target.lean_attention = True, attention
    if float32:
        return (f"verify check: lean forward on {where}, the model's own attention: {STEPS_PROBE} one-token steps and "
                f"a {STEPS_PROBE}-token verify give transformers' logits bit for bit")
    return (f"verify check: lean forward on {where}: {STEPS_PROBE} one-token steps give transformers' logits bit "
            f"for bit")


LEAN_DATA_TOLERANCE = 1e-4  # of the largest |logit|: float32's summation orders differ by ~1e-6 of it


def lean_for_answers(target: TargetModel) -> str:
    """Turn the lean forward on for a float32 target that answers prompts (data.engines.RuntimeEngine), not one that
    decodes exactly: there its row attention sums in another order than torch's sdpa, so its logits are transformers'
    up to float32 rounding, not bit for bit (a near-tie can flip, as between any two engines). Checked first on
    STEPS_PROBE one-token steps: logits and last hidden states within LEAN_DATA_TOLERANCE of the largest |value| of
    transformers' forward, every step's argmax equal, and its own verify == its steps. Returns the one line saying
    what was decided ('' where it does not apply: not float32, not a model the lean forward serves)."""
    if target.dtype != torch.float32 or target.mode != "tree" or (target.lean_wanted and target.lean_attention == "rows") \
            or lean_unavailable(target.model, float32=True) or (target.max_positions is not None
                                                                 and target.max_positions <= PREFIX_LENGTH + STEPS_PROBE):
        return ""
    if _lean_off_by_env():
        return f"answers: lean forward off (${LEAN_ENV}); transformers' forward answers"
    reference, lean = _reference_and_lean(target, "rows", STEPS_PROBE, 1)
    if isinstance(lean, Exception):
        raise lean
    gap = max(float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))
              for got, want in zip(lean[:2], reference[:2], strict=True))
    same_argmax = torch.equal(lean[0].argmax(-1), reference[0].argmax(-1))
    if gap <= LEAN_DATA_TOLERANCE and same_argmax and torch.equal(lean[2], lean[0]):
        target.lean_wanted, target.lean_attention = True, "rows"
        return (f"answers: lean forward on (float32): logits and hidden states within {gap:.1e} of transformers' "
                f"forward (the largest |value| as the unit), argmax equal on {STEPS_PROBE} steps")
    forward = "the lean forward with the model's attention" if target.lean_wanted else "transformers' forward"
    return (f"answers: lean forward off (float32: {gap:.1e} from transformers' forward, argmax "
            f"{'equal' if same_argmax else 'differs'}); {forward} answers")


def prepare_target(model: PreTrainedModel, flag: str = "--model", use_cache: bool = True, log=None,
                   layout: str = "auto") -> TargetModel:
    """Self-check `model` (cached), print the one-line verdict to `log` (stderr), and return the TargetModel in
    the chosen mode, its weights in `layout` (runtime.layout: auto measures which is faster on this CPU); a
    refused model raises TargetError naming the model class and why."""
    check_layout(layout, "--weight_layout" if flag == "--model" else f"{flag} weight layout")
    result = verify_check(model, use_cache)
    if result.mode == "refused":  # the error line is the verdict
        name = getattr(model.config, "_name_or_path", "") or "(built in memory)"
        raise TargetError(f"{flag} {name} ({type(model).__name__}) cannot be decoded exactly by this runtime: "
                          f"{result.reason}")
    print(result.line(), file=log or sys.stderr)
    target = TargetModel(model, flag=flag, mode=result.mode)
    chosen = choose_layout(target, layout, use_cache, log)
    probe_fits = target.max_positions is None or target.max_positions > PREFIX_LENGTH + STEPS_PROBE
    if probe_fits:
        line = lean_line(target, chosen, use_cache)  # '' where the lean forward does not serve this target
        if line:
            print(line, file=log or sys.stderr)
    if result.mode in ("tree", "chain") and target.dtype in (torch.bfloat16, torch.float16) and probe_fits:
        print(steps_line(target, chosen if not target.lean_wanted else f"{chosen}, lean", use_cache),
              file=log or sys.stderr)
    return target
