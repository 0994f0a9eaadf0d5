"""Train a recipe ladder x seeds x sizes, capture and replay, and write the ablation tables.

The entry point of tools/ablate (`main`). One *run* is one (size, recipe, seed): a model trained
for --steps steps (then on to --overrun x --steps at the final learning rate) on byte-level text (the corpus of tools/capture/train_tiny_llama.py: the Python
standard library's *.py files, every 10th file validation), evaluated at step 0, every
--eval-every steps and at the last step on the same validation batches for every run.

Output directory:
  evals.csv        one row per evaluation: size, recipe, seed, step, tokens, train_loss, val_loss, wall_s,
                   schedule_steps (rows past it: the overrun at the final learning rate, --overrun).
                   A run's rows are appended all at once when it finishes, under a file lock, by an
                   atomic rewrite (temporary file, fsync, rename): a run is either complete in
                   evals.csv or absent, so a rerun skips exactly the complete runs.
  runs/SIZE/RECIPE/seedS/   run.json (config, device, wall time, divergence), log.txt (workers),
                   capture/ (with --capture), replay/{early,late}/ (with --replay)
  run.json         provenance: hardware, torch and Python versions, every invocation's command
                   line and wall time, per-run wall times, the corpus
  runs.csv, overhead.csv, overhead.md, predictors.csv (every quantized recipe), predictors_mxfp4.csv
                   (the MXFP4 recipes only), metrics.csv, loss_curves.png, overhead.png (analyze())

Recipes. "bf16" (bf16 autocast, no quantization) and "fp32" (no autocast, TF32 off) are defined
here and need neither mxscope.torch nor `convert`. Every other name is looked up in
mxscope.torch.LADDER and applied with mxscope.torch.convert(model, recipe, include=PROJECTIONS)
under bf16 autocast, the run's seed becoming the recipe's seed (its SR and random-sign streams);
mxscope.torch.set_step(model, step) is called before every step.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import math
import os
import platform
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from . import analysis, strategies

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
PYTHON_ROOT = os.path.join(REPO_ROOT, "python")
CAPTURE_TOOLS = os.path.join(REPO_ROOT, "tools", "capture")

#: schedule_steps: the step where the learning-rate schedule ends; rows past it are the overrun.
EVAL_COLUMNS = ("size", "recipe", "seed", "step", "tokens", "train_loss", "val_loss", "wall_s", "schedule_steps")
#: final_val_loss: at the end of the schedule (the loss the target is made of); last_val_loss: at the
#: last evaluation (the end of the overrun, if any).
RUN_COLUMNS = ("size", "recipe", "seed", "tokens_to_target", "overhead", "final_val_loss", "diverged",
               "reached", "paired_overhead", "target", "last_val_loss", "divergence_reason")
OVERHEAD_COLUMNS = ("size", "recipe", "overhead", "interval", "interval_lo", "interval_hi", "reached", "seeds",
                    "n_diverged", "target", "target_rule", "baseline_tokens", "tokens_to_target")

#: The ladder of issue 29, in order (neighbours in the replay are neighbours in this order).
LADDER = ("bf16", "fp8", "mxfp4-f", "mxfp4-fd", "mxfp4-fdw", "mxfp4-fdw-sr", "mxfp4-fdw-rht", "mxfp4-fdw-h16",
          "mxfp4-fdw-h16fixed", "mxfp4-fdw-sr-rht", "nvfp4-fdw", "nvfp4-te", "mxfp4-fdw-h16all")
#: The recipes of predictors_mxfp4.csv: the predictor test within the MXFP4 family.
FAMILY_PREFIX = "mxfp4-"
#: Recipes that need no quantization: name -> bf16 autocast on?
BUILTIN_RECIPES = {"bf16": True, "fp32": False}

#: Model sizes: d_model, layers, heads, ffn, seq, batch (sequences per step).
SIZES = {
    "tiny": dict(d_model=32, layers=2, heads=2, ffn=96, seq=32, batch=2),
    "d256": dict(d_model=256, layers=4, heads=4, ffn=704, seq=256, batch=16),
    "d512": dict(d_model=512, layers=4, heads=8, ffn=1408, seq=256, batch=16),
    "d768": dict(d_model=768, layers=4, heads=12, ffn=2048, seq=256, batch=16),
}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: backend -> (block list prefix, attention module, MLP module) in the model's module names.
BACKEND_NAMES = {"tiny-llama": ("layers", "attn", "mlp"), "hf-llama": ("model.layers", "self_attn", "mlp")}


# ------------------------------------------------------------------------------------------------
# Options of one run.


@dataclass
class RunOptions:
    out: str
    size: str
    size_config: Dict[str, int]
    recipe: str
    seed: int
    steps: int
    eval_every: int
    overrun: float = 1.0
    eval_batches: int = 8
    lr: float = 3e-3
    warmup: int = 0
    weight_decay: float = 0.1
    clip: float = 1.0
    model: str = "tiny-llama"
    device: str = "auto"
    max_corpus_bytes: Optional[int] = None
    threads: int = 0
    capture: bool = False
    capture_layers: Tuple[int, ...] = ()
    capture_windows: Dict[str, Tuple[int, int]] = field(default_factory=dict)

    @property
    def key(self) -> Tuple[str, str, int]:
        return (self.size, self.recipe, self.seed)

    @property
    def run_dir(self) -> str:
        return os.path.join(self.out, "runs", self.size, self.recipe, f"seed{self.seed}")


def capture_windows(steps: int, window: int, early_start: Optional[int]) -> Dict[str, Tuple[int, int]]:
    """Early and late windows of `window` consecutive steps: early from `early_start` (default: step
    10 % into the schedule, past the first steps' large gradients), late ending at the last step."""
    window = max(1, min(window, steps))
    start = early_start if early_start is not None else max(1, steps // 10)
    early = (start, min(steps, start + window - 1))
    late = (max(early[1] + 1, steps - window + 1), steps)
    out = {"early": early}
    if late[0] <= late[1]:
        out["late"] = late
    return out


def default_capture_layers(layers: int) -> Tuple[int, ...]:
    """Two blocks: the second and the last (the first and the last with two blocks)."""
    if layers <= 1:
        return (0,)
    return (1 if layers > 2 else 0, layers - 1)


# ------------------------------------------------------------------------------------------------
# Model and recipe.


def _import_trainer():
    if CAPTURE_TOOLS not in sys.path:
        sys.path.insert(0, CAPTURE_TOOLS)
    import train_tiny_llama  # noqa: E402  (tools/capture: the model, the corpus, the schedule)
    return train_tiny_llama


def capture_class():
    """mxscope.capture.Capture when the package provides it, else tools/capture's (same API)."""
    try:
        from mxscope.capture import Capture  # type: ignore
        return Capture
    except ImportError:
        if CAPTURE_TOOLS not in sys.path:
            sys.path.insert(0, CAPTURE_TOOLS)
        from mxscope_capture import Capture  # noqa: E402
        return Capture


class Backend:
    """A model with logits(tokens) and the module names of its block projections."""

    def __init__(self, kind: str, config: Dict[str, int]):
        self.kind = kind
        if kind == "tiny-llama":
            trainer = _import_trainer()
            self.model = trainer.TinyLlama(trainer.ModelConfig(
                d_model=config["d_model"], layers=config["layers"], heads=config["heads"], ffn=config["ffn"],
                seq=config["seq"]))
            self.prefix, self.attn, self.mlp = BACKEND_NAMES[kind]
            self.description = "tools/capture TinyLlama (RMSNorm, RoPE, SwiGLU, no biases, untied, byte vocabulary)"
        elif kind == "hf-llama":
            import transformers  # the GPU machine has it; config built here, nothing downloaded
            hf_config = transformers.LlamaConfig(
                vocab_size=256, hidden_size=config["d_model"], intermediate_size=config["ffn"],
                num_hidden_layers=config["layers"], num_attention_heads=config["heads"],
                num_key_value_heads=config["heads"], max_position_embeddings=config["seq"], rms_norm_eps=1e-5,
                hidden_act="silu", tie_word_embeddings=False, attention_bias=False, use_cache=False)
            self.model = transformers.LlamaForCausalLM(hf_config)
            self.prefix, self.attn, self.mlp = BACKEND_NAMES[kind]
            self.description = f"transformers {transformers.__version__} LlamaForCausalLM (config built in code)"
        else:
            raise ValueError(f"unknown model backend {kind!r} (tiny-llama or hf-llama)")

    def logits(self, tokens):
        out = self.model(tokens)
        return out if self.kind == "tiny-llama" else out.logits

    def projections_regex(self, layers: Optional[Sequence[int]] = None) -> str:
        return projections_regex(self.prefix, self.attn, self.mlp, layers)


def projections_regex(prefix: str, attn: str, mlp: str, layers: Optional[Sequence[int]] = None) -> str:
    """re.fullmatch pattern of the seven projections (q, k, v, o, gate, up, down) of the given
    blocks (every block if None): PREFIX.I.ATTN.{q,k,v,o}_proj and PREFIX.I.MLP.{gate,up,down}_proj."""
    index = r"\d+" if layers is None else "(?:" + "|".join(str(int(i)) for i in layers) + ")"
    p = re.escape(prefix)
    return rf"{p}\.{index}\.(?:{re.escape(attn)}\.(?:q|k|v|o)_proj|{re.escape(mlp)}\.(?:gate|up|down)_proj)"


def resolve_recipe(name: str, seed: int):
    """(recipe object or None, autocast on, unquantized format). None: a built-in recipe, nothing
    to convert. Others come from mxscope.torch.LADDER with the run's seed."""
    if name in BUILTIN_RECIPES:
        autocast = BUILTIN_RECIPES[name]
        return None, autocast, ("bf16" if autocast else "fp32")
    import mxscope.torch as mt  # noqa: E402  (only quantized recipes need the package)
    if name not in mt.LADDER:
        raise SystemExit(f"unknown recipe {name!r}: not built in ({sorted(BUILTIN_RECIPES)}) and not in "
                         f"mxscope.torch.LADDER ({sorted(mt.LADDER)})")
    base = mt.LADDER[name]
    recipe = mt.Recipe(name=base.name, fprop=base.fprop, dgrad=base.dgrad, wgrad=base.wgrad, seed=seed)
    return recipe, True, "bf16"


def check_recipes(names: Sequence[str]) -> None:
    """Refuse, before any training, recipe names that are neither built in nor in
    mxscope.torch.LADDER (or that need mxscope.torch where it cannot be imported)."""
    quantized = [n for n in names if n not in BUILTIN_RECIPES]
    if not quantized:
        return
    try:
        import mxscope.torch as mt
    except ImportError as error:
        raise SystemExit(f"recipes {quantized} need mxscope.torch (the mxscope Python package), which cannot be "
                         f"imported: {error}; the built-in recipes are {sorted(BUILTIN_RECIPES)}")
    unknown = [n for n in quantized if n not in mt.LADDER]
    if unknown:
        raise SystemExit(f"unknown recipes {unknown}: not built in ({sorted(BUILTIN_RECIPES)}) and not in "
                         f"mxscope.torch.LADDER ({sorted(mt.LADDER)})")


def parameter_count(config: Dict[str, int], vocab: int = 256) -> int:
    """Parameters of the TinyLlama of this config (embeddings and head included)."""
    d, f, layers = config["d_model"], config["ffn"], config["layers"]
    per_block = 4 * d * d + 3 * d * f + 2 * d
    return layers * per_block + 2 * vocab * d + d


# ------------------------------------------------------------------------------------------------
# One run.


def _device(choice: str):
    import torch
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(choice)


def train_one(options: RunOptions) -> List[Dict[str, object]]:
    """Train one run and return its evaluation rows (EVAL_COLUMNS); writes run_dir/run.json."""
    import torch
    import torch.nn.functional as F

    trainer = _import_trainer()
    started = time.time()
    if options.threads:
        torch.set_num_threads(options.threads)
    device = _device(options.device)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32, for the fp32 recipe and the fake quantizers
    torch.backends.cudnn.allow_tf32 = False
    config = options.size_config
    torch.manual_seed(options.seed)
    backend = Backend(options.model, config)
    model = backend.model.to(device)
    recipe, use_autocast, _ = resolve_recipe(options.recipe, options.seed)
    mt = None
    if recipe is not None:
        import mxscope.torch as mt  # noqa: F811
        model = mt.convert(model, recipe, include=backend.projections_regex())  # in place; returns the model
        backend.model = model

    train_data, validation_data, corpus = trainer.load_corpus(options.max_corpus_bytes)
    decay = [p for p in model.parameters() if p.dim() == 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": options.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=options.lr, betas=(0.9, 0.95), eps=1e-8)
    batch, seq = config["batch"], config["seq"]
    tokens_per_step = batch * seq
    warmup = options.warmup or max(1, options.steps // 10)

    os.makedirs(options.run_dir, exist_ok=True)
    capture = None
    if options.capture:
        dump = os.path.join(options.run_dir, "capture")
        shutil.rmtree(dump, ignore_errors=True)  # a capture of an unfinished earlier attempt
        capture_steps = sorted({s for a, b in options.capture_windows.values() for s in range(a, b + 1)})
        Capture = capture_class()
        capture = Capture(model, dump, layers=backend.projections_regex(options.capture_layers),
                          steps=capture_steps,
                          source={"recipe": options.recipe, "model": f"{backend.description}, {config}",
                                  "notes": f"tools/ablate run size {options.size} seed {options.seed}; windows "
                                           f"{options.capture_windows}"})

    def autocast():
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=use_autocast)

    @torch.no_grad()
    def evaluate() -> float:
        model.eval()
        generator = torch.Generator().manual_seed(20261201)  # the same validation batches for every run
        total = 0.0
        for _ in range(options.eval_batches):
            inputs, targets = trainer.batch_from(validation_data, batch, seq, generator)
            with autocast():
                logits = backend.logits(inputs.to(device))
            total += F.cross_entropy(logits.float().reshape(-1, 256), targets.to(device).reshape(-1)).item()
        model.train()
        return total / options.eval_batches

    rows = []
    # After the schedule's last step the run goes on at the final learning rate (the schedule's
    # floor) up to overrun x steps, so that a recipe slower than bf16 can still reach bf16's loss
    # at the end of the schedule and its tokens to target are measured instead of "not reached".
    total_steps = max(options.steps, int(round(options.steps * options.overrun)))

    def record(step, train_loss):
        rows.append({"size": options.size, "recipe": options.recipe, "seed": options.seed, "step": step,
                     "tokens": step * tokens_per_step, "train_loss": train_loss, "val_loss": evaluate(),
                     "wall_s": round(time.time() - started, 3), "schedule_steps": options.steps})

    generator = torch.Generator().manual_seed(options.seed)
    record(0, float("nan"))
    stopped = None
    for step in range(1, total_steps + 1):
        lr = trainer.learning_rate(step, options.steps, options.lr, warmup)  # the floor after the schedule
        for group in optimizer.param_groups:
            group["lr"] = lr
        if mt is not None:
            mt.set_step(model, step)
        if capture is not None:
            capture.begin_step(step)
        inputs, targets = trainer.batch_from(train_data, batch, seq, generator)
        with autocast():
            logits = backend.logits(inputs.to(device))
        loss = F.cross_entropy(logits.float().reshape(-1, 256), targets.to(device).reshape(-1))
        loss.backward()
        if capture is not None:
            capture.after_backward(step)
        torch.nn.utils.clip_grad_norm_(model.parameters(), options.clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        train_loss = loss.item()
        if not math.isfinite(train_loss):
            record(step, train_loss)  # nothing to learn after a non-finite loss: stop, the curve shows why
            stopped = f"non-finite training loss at step {step}"
            break
        if step % options.eval_every == 0 or step in (options.steps, total_steps):
            record(step, train_loss)
    if capture is not None:
        capture.close()

    curve = [(r["tokens"], r["val_loss"]) for r in rows]
    info = {"key": list(options.key), "options": asdict(options), "model": backend.description,
            "parameters": sum(p.numel() for p in model.parameters()), "tokens_per_step": tokens_per_step,
            "warmup": warmup, "total_steps": total_steps, "device": _device_name(device), "torch": torch.__version__,
            "wall_s": round(time.time() - started, 3), "stopped": stopped,
            "divergence": analysis.divergence(curve, [r["train_loss"] for r in rows[1:]]),
            "corpus": corpus, "host": socket.gethostname()}
    _atomic_write(os.path.join(options.run_dir, "run.json"), json.dumps(info, indent=1, default=str) + "\n")
    return rows


def _device_name(device) -> str:
    import torch
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.machine()}, {os.cpu_count()} cores)"


# ------------------------------------------------------------------------------------------------
# evals.csv: atomic appends, resumability.


def _atomic_write(path: str, text: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", newline="") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    with contextlib.suppress(OSError):
        fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def _locked(path: str):
    import fcntl
    with open(path + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _format(value) -> str:
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else ("nan" if math.isnan(value) else ("inf" if value > 0 else "-inf"))
    return str(value)


def read_evals(path: str) -> List[Dict[str, str]]:
    return analysis.read_csv(path) if os.path.exists(path) else []


def completed_runs(path: str) -> set:
    """(size, recipe, seed) of every run in evals.csv (present means complete: see module docstring)."""
    return {(r["size"], r["recipe"], int(r["seed"])) for r in read_evals(path)}


def append_run(path: str, rows: List[Dict[str, object]]) -> bool:
    """Add one run's rows to evals.csv atomically; False (nothing written) when it is already there."""
    if not rows:
        return False
    key = (str(rows[0]["size"]), str(rows[0]["recipe"]), int(rows[0]["seed"]))
    with _locked(path):
        existing = ""
        if os.path.exists(path):
            with open(path, newline="") as handle:
                existing = handle.read()
        if key in completed_runs(path):
            return False
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        if not existing:
            writer.writerow(EVAL_COLUMNS)
        elif not existing.endswith("\n"):
            existing += "\n"
        for row in rows:
            writer.writerow([_format(row[c]) for c in EVAL_COLUMNS])
        _atomic_write(path, existing + buffer.getvalue())
    return True


# ------------------------------------------------------------------------------------------------
# Replay.


def find_mxscope(explicit: Optional[str]) -> Optional[str]:
    if explicit:
        return explicit
    found = shutil.which("mxscope")
    if found:
        return found
    for candidate in ("build/mxscope", "build/src/cli/mxscope", "build/src/mxscope"):
        path = os.path.join(REPO_ROOT, candidate)
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def replay_run(run_dir: str, recipe: str, seed: int, strategies_for: Sequence[str],
               windows: Dict[str, Tuple[int, int]], mxscope: str, device: str = "cpu", threads: int = 0,
               attribute: bool = False, log=print, deadline: Optional[float] = None) -> Dict[str, str]:
    """Replay run_dir/capture under `strategies_for` (the run's recipe first), one replay per
    capture window; returns window -> replay directory. With a deadline (time.time() value) a
    replay still running then is killed (subprocess.TimeoutExpired propagates); its directory is
    finished with --resume by the next call."""
    entries = []
    for name in strategies_for:
        obj, _, unquantized = resolve_recipe(name, seed)
        entries.append((name, obj, seed, unquantized))
        for gemm in strategies.GEMMS:
            extra = strategies.unmapped_fields(getattr(obj, gemm, None) if obj is not None else None)
            if extra:
                log(f"warning: {name} {gemm}: recipe fields {extra} have no replay key; the replay does not "
                    f"reproduce them")
    replay_dir = os.path.join(run_dir, "replay")
    os.makedirs(replay_dir, exist_ok=True)
    toml_path = os.path.join(replay_dir, "analysis.toml")
    _atomic_write(toml_path, strategies.analysis_toml(entries, f"ablate-{recipe}", attribute=attribute))
    out = {}
    for window, (first, last) in sorted(windows.items()):
        target = os.path.join(replay_dir, window)
        out[window] = target
        if os.path.exists(os.path.join(target, "summary.json")):
            continue
        command = [mxscope, "replay", os.path.join(run_dir, "capture"), "--analysis", toml_path, "--out", target,
                   "--steps", f"{first}-{last}", "--device", device]
        if threads:
            command += ["--threads", str(threads)]
        if attribute:
            command.append("--attribute")
        if os.path.exists(target):
            command.append("--resume")
        log("replay: " + " ".join(command))
        timeout = None if deadline is None else max(1.0, deadline - time.time())
        subprocess.run(command, check=True, timeout=timeout)
    return out


# ------------------------------------------------------------------------------------------------
# Tables.


def curves_from_evals(rows: List[Dict[str, str]]):
    """(size, recipe, seed) -> ([(tokens, val_loss)], [train_loss], schedule end in tokens or None)
    sorted by step (schedule end None: no schedule_steps column, the last evaluation ends it)."""
    grouped: Dict[Tuple[str, str, int], List[Dict[str, str]]] = {}
    for row in rows:
        grouped.setdefault((row["size"], row["recipe"], int(row["seed"])), []).append(row)
    out = {}
    for key, items in grouped.items():
        items.sort(key=lambda r: int(r["step"]))
        curve = [(float(r["tokens"]), analysis._number(r["val_loss"])) for r in items]
        train = [analysis._number(r["train_loss"]) for r in items if int(r["step"]) > 0]
        schedule = None
        if items[0].get("schedule_steps") not in (None, ""):
            end = int(items[0]["schedule_steps"])
            schedule = next((float(r["tokens"]) for r in items if int(r["step"]) == end), None)
        out[key] = (curve, train, schedule)
    return out


def _write_csv(path: str, columns: Sequence[str], rows: List[Dict[str, object]]) -> None:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(columns)
    for row in rows:
        writer.writerow([_format(row.get(c, "")) for c in columns])
    _atomic_write(path, buffer.getvalue())


def overhead_tables(evals: List[Dict[str, str]], target_rule: str = "mean", n_boot: int = 2000, seed: int = 0):
    """(runs rows, overhead rows, size -> recipe -> overhead) from evals.csv rows (RUN_COLUMNS,
    OVERHEAD_COLUMNS). A size without bf16 runs gets nan overheads."""
    curves = curves_from_evals(evals)
    sizes = sorted({k[0] for k in curves})
    run_rows, overhead_rows, overheads = [], [], {}
    for size in sizes:
        recipes = sorted({k[1] for k in curves if k[0] == size}, key=lambda r: (r != "bf16", r))
        bf16 = {k[2]: curves[k][0] for k in curves if k[0] == size and k[1] == "bf16"}
        ends = {curves[k][2] for k in curves if k[0] == size and k[1] == "bf16"}
        if len(ends) > 1:
            raise SystemExit(f"size {size}: bf16 runs with different schedules ({sorted(map(str, ends))}); "
                             f"use one --steps per size")
        schedule_tokens = ends.pop() if ends else None
        overheads[size] = {}
        for recipe in recipes:
            mine = {k[2]: curves[k][0] for k in curves if k[0] == size and k[1] == recipe}
            summary = analysis.overhead_summary(mine, bf16, target_rule=target_rule, n_boot=n_boot, seed=seed,
                                                schedule_tokens=schedule_tokens)
            overheads[size][recipe] = summary.overhead
            n_div = 0
            for s, curve in sorted(mine.items()):
                reason = analysis.divergence(curve, curves[(size, recipe, s)][1])
                n_div += reason is not None
                info = summary.per_seed[s]
                run_rows.append({
                    "size": size, "recipe": recipe, "seed": s,
                    "tokens_to_target": analysis.INF if info["tokens"] is None else info["tokens"],
                    "overhead": info["overhead_vs_baseline"],
                    "final_val_loss": analysis.loss_at(curve, curves[(size, recipe, s)][2]),
                    "last_val_loss": curve[-1][1],
                    "diverged": reason is not None, "reached": info["tokens"] is not None,
                    "paired_overhead": info["paired_overhead"],
                    "target": summary.target if summary.target is not None else analysis.NAN,
                    "divergence_reason": reason or ""})
            lo, hi = summary.lo, summary.hi
            overhead_rows.append({
                "size": size, "recipe": recipe, "overhead": summary.overhead, "interval": f"[{lo:.4f}, {hi:.4f}]",
                "interval_lo": lo, "interval_hi": hi, "reached": summary.reached,
                "seeds": " ".join(str(s) for s in summary.seeds), "n_diverged": n_div,
                "target": summary.target if summary.target is not None else analysis.NAN, "target_rule": target_rule,
                "baseline_tokens": summary.baseline_tokens if summary.baseline_tokens is not None else analysis.NAN,
                "tokens_to_target": summary.tokens if summary.tokens is not None else analysis.INF})
    return run_rows, overhead_rows, overheads


def overhead_markdown(overhead_rows: List[Dict[str, object]], run_rows: List[Dict[str, object]]) -> str:
    """The overhead table as Markdown, one section per size, recipes in the order of overhead.csv."""
    lines = ["# Tokens to target relative to bf16", ""]
    for size in sorted({r["size"] for r in overhead_rows}):
        rows = [r for r in overhead_rows if r["size"] == size]
        target = rows[0]["target"]
        lines += [f"## size {size}", "", f"target (bf16 final validation loss, rule {rows[0]['target_rule']}): "
                  f"{_format(target) if not isinstance(target, float) or not math.isfinite(target) else f'{target:.4f}'}",
                  "", "| recipe | overhead | 95% interval | reached | seeds | diverged | final val loss (mean) |",
                  "|---|---|---|---|---|---|---|"]
        for r in rows:
            finals = [float(x["final_val_loss"]) for x in run_rows if x["size"] == size and x["recipe"] == r["recipe"]]
            mean_final = sum(finals) / len(finals) if finals else analysis.NAN
            value = r["overhead"]
            shown = "not reached" if value == analysis.INF else ("n/a" if math.isnan(value) else f"{value:+.1%}")
            lo, hi = r["interval_lo"], r["interval_hi"]
            interval = "n/a" if math.isnan(lo) else "[" + ", ".join(
                "inf" if math.isinf(v) else f"{v:+.1%}" for v in (lo, hi)) + "]"
            lines.append(f"| {r['recipe']} | {shown} | {interval} | {r['reached']} | {r['seeds']} | "
                         f"{r['n_diverged']} | {mean_final:.4f} |")
        lines.append("")
    return "\n".join(lines)


def _replayed_seeds(recipe_dir: str) -> List[int]:
    """Seeds under recipe_dir with at least one finished replay window (a summary.json): a replay
    directory left unfinished by a stopped invocation, whose capture is gone, does not count."""
    if not os.path.isdir(recipe_dir):
        return []
    out = []
    for name in os.listdir(recipe_dir):
        replay_dir = os.path.join(recipe_dir, name, "replay")
        if name.startswith("seed") and os.path.isdir(replay_dir) and any(
                os.path.exists(os.path.join(replay_dir, w, "summary.json")) for w in os.listdir(replay_dir)):
            out.append(int(name[4:]))
    return sorted(out)


def collect_metrics(out: str, overheads: Dict[str, Dict[str, float]]) -> Dict[str, Dict[str, Dict[str, float]]]:
    """size -> recipe -> metric -> value from the replays under runs/. Metric names:
    "own.WINDOW.GEMM.METRIC" (the recipe's strategy on its own run's capture, the lowest seed with a
    finished replay) and "bf16cap.WINDOW.GEMM.METRIC" (the recipe's strategy on the bf16 run's capture)."""
    metrics: Dict[str, Dict[str, Dict[str, float]]] = {}
    root = os.path.join(out, "runs")
    for size in sorted(overheads):
        metrics[size] = {}
        for recipe in sorted(overheads[size]):
            recipe_dir = os.path.join(root, size, recipe)
            seeds = _replayed_seeds(recipe_dir)
            if seeds:
                values = metrics[size].setdefault(recipe, {})
                replay_dir = os.path.join(recipe_dir, f"seed{seeds[0]}", "replay")
                for window in sorted(os.listdir(replay_dir)):
                    path = os.path.join(replay_dir, window)
                    if not os.path.exists(os.path.join(path, "summary.json")):
                        continue
                    per_strategy = analysis.replay_metrics(path)
                    for name, value in per_strategy.get(recipe, {}).items():
                        values[f"own.{window}.{name}"] = value
        bf16_dir = os.path.join(root, size, "bf16")
        if os.path.isdir(bf16_dir):
            seeds = _replayed_seeds(bf16_dir)
            if seeds:
                replay_dir = os.path.join(bf16_dir, f"seed{seeds[0]}", "replay")
                for window in sorted(os.listdir(replay_dir)):
                    path = os.path.join(replay_dir, window)
                    if not os.path.exists(os.path.join(path, "summary.json")):
                        continue
                    for strategy, values in analysis.replay_metrics(path).items():
                        if strategy in overheads[size]:
                            target = metrics[size].setdefault(strategy, {})
                            for name, value in values.items():
                                target[f"bf16cap.{window}.{name}"] = value
    return metrics


AGREEMENT_COLUMNS = ("size", "metric", "n_recipes", "spearman", "median_rel_diff", "max_rel_diff")


def metrics_agreement(metrics: Mapping[str, Mapping[str, Mapping[str, float]]],
                      other_rows: Sequence[Mapping[str, str]]) -> List[Dict[str, object]]:
    """For each (size, metric) present in both `metrics` and another directory's metrics.csv rows:
    the number of recipes with a finite value in both, Spearman's rho between the two across those
    recipes, and the median and largest relative difference |a - b| / max(|a|, |b|) (0 when both
    are 0). It says how much a metric moves between two captures of the same recipe and seed."""
    other: Dict[Tuple[str, str], Dict[str, float]] = {}
    for row in other_rows:
        other.setdefault((row["size"], row["metric"]), {})[row["recipe"]] = analysis._number(row["value"])
    rows = []
    for size in sorted(metrics):
        names = sorted({m for per in metrics[size].values() for m in per})
        for name in names:
            theirs = other.get((size, name))
            if not theirs:
                continue
            pairs = [(per[name], theirs[r]) for r, per in sorted(metrics[size].items())
                     if name in per and r in theirs and analysis._finite(per[name]) and analysis._finite(theirs[r])]
            if not pairs:
                continue
            diffs = sorted(0.0 if a == b else abs(a - b) / max(abs(a), abs(b)) for a, b in pairs)
            rho = analysis.spearman_rho([a for a, _ in pairs], [b for _, b in pairs]) if len(pairs) >= 3 else math.nan
            rows.append({"size": size, "metric": name, "n_recipes": len(pairs), "spearman": rho,
                         "median_rel_diff": diffs[len(diffs) // 2], "max_rel_diff": diffs[-1]})
    return rows


def analyze(out: str, target_rule: str = "mean", n_boot: int = 2000, predictor_boot: int = 1000,
            plot: bool = True, log=print, overheads_from: Optional[str] = None) -> Dict[str, object]:
    """Write runs.csv, overhead.csv, metrics.csv and predictors.csv (when replays exist) and the plot.
    overheads_from: another ablation directory whose evals.csv gives the overheads (the replays of
    `out` then only add metrics, e.g. replays with --attribute of retrained capture runs); the run
    tables and plots stay in that directory, and metrics_agreement.csv compares the metrics of the
    two directories' replays."""
    evals = read_evals(os.path.join(overheads_from or out, "evals.csv"))
    run_rows, overhead_rows, overheads = overhead_tables(evals, target_rule=target_rule, n_boot=n_boot)
    if overheads_from is None:
        _write_csv(os.path.join(out, "runs.csv"), RUN_COLUMNS, run_rows)
        _write_csv(os.path.join(out, "overhead.csv"), OVERHEAD_COLUMNS, overhead_rows)
    metrics = collect_metrics(out, overheads)
    metric_rows = [{"size": s, "recipe": r, "metric": m, "value": v}
                   for s in sorted(metrics) for r in sorted(metrics[s]) for m, v in sorted(metrics[s][r].items())]
    predictors = []
    if metric_rows:
        _write_csv(os.path.join(out, "metrics.csv"), ("size", "recipe", "metric", "value"), metric_rows)
        predictors = analysis.predictor_table(overheads, metrics, n_boot=predictor_boot)
        _write_csv(os.path.join(out, "predictors.csv"), analysis.PREDICTOR_COLUMNS, predictors)
        # The same test within one format family: across all recipes a metric can pass merely by
        # telling fp8 from NVFP4 from MXFP4 (their overheads differ by family); among the MXFP4
        # recipes only the rounding, rotation and GEMM choices differ, which is the question a
        # user choosing an MXFP4 recipe asks.
        family = {size: {r: v for r, v in per.items() if r.startswith(FAMILY_PREFIX)} for size, per in overheads.items()}
        _write_csv(os.path.join(out, "predictors_mxfp4.csv"), analysis.PREDICTOR_COLUMNS,
                   analysis.predictor_table(family, metrics, n_boot=predictor_boot))
    else:
        log("no replay results under runs/: predictors.csv not written (run with --capture --replay)")
    if overheads_from is not None:
        other = os.path.join(overheads_from, "metrics.csv")
        if metric_rows and os.path.exists(other):
            _write_csv(os.path.join(out, "metrics_agreement.csv"), AGREEMENT_COLUMNS,
                       metrics_agreement(metrics, analysis.read_csv(other)))
        return {"runs": run_rows, "overhead": overhead_rows, "predictors": predictors}
    _atomic_write(os.path.join(out, "overhead.md"), overhead_markdown(overhead_rows, run_rows))
    if plot:
        from . import plots
        plots.loss_curves(evals, os.path.join(out, "loss_curves.png"),
                          {row["size"]: row["target"] for row in overhead_rows}, log=log)
        plots.overhead_bars(overhead_rows, os.path.join(out, "overhead.png"), log=log)
    return {"runs": run_rows, "overhead": overhead_rows, "predictors": predictors}


# ------------------------------------------------------------------------------------------------
# The command line.


def parse_list(text: str) -> List[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def parse_size(text: str) -> Tuple[str, Dict[str, int]]:
    """"NAME=d_model:layers:heads:ffn:seq:batch" -> (NAME, config)."""
    name, _, spec = text.partition("=")
    values = [int(v) for v in spec.split(":")]
    if not name or len(values) != 6:
        raise argparse.ArgumentTypeError(f"--size {text!r}: expected NAME=d_model:layers:heads:ffn:seq:batch")
    return name, dict(zip(("d_model", "layers", "heads", "ffn", "seq", "batch"), values))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ablate", description="Train a recipe ladder x seeds x sizes on byte-level text, measure tokens to the "
                                   "bf16 target, capture and replay, and validate replay metrics as predictors.")
    p.add_argument("--out", required=True, help="output directory (created; rerun to resume)")
    p.add_argument("--sizes", default="tiny", help=f"comma-separated size names (presets: {', '.join(SIZES)})")
    p.add_argument("--size", action="append", type=parse_size, default=[],
                   help="define a size: NAME=d_model:layers:heads:ffn:seq:batch (repeatable)")
    p.add_argument("--recipes", default="ladder", help='comma-separated recipes, or "ladder" for the issue-29 ladder')
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--overrun", type=float, default=1.5,
                   help="train to OVERRUN x --steps, past the schedule's end at its final learning rate, so that "
                        "recipes slower than bf16 can reach the target (1: stop at the schedule's end)")
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=0, help="warmup steps (default: 10%% of --steps)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--model", choices=("tiny-llama", "hf-llama"), default="tiny-llama")
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu or cuda")
    p.add_argument("--parallel", type=int, default=1, help="runs trained at once, as subprocesses (sharing one GPU)")
    p.add_argument("--threads", type=int, default=0, help="torch threads per run (default: cores / --parallel)")
    p.add_argument("--max-corpus-bytes", type=int, default=None, help="truncate the corpus (smoke tests)")
    p.add_argument("--capture", action="store_true", help="capture the 7 projections of two blocks, early/late windows")
    p.add_argument("--capture-seeds", default=None, help="seeds that capture (default: the first seed)")
    p.add_argument("--capture-layers", default=None, help="block indices (default: the second and the last)")
    p.add_argument("--capture-window", type=int, default=8, help="consecutive steps per window")
    p.add_argument("--capture-early", type=int, default=None, help="first step of the early window (default 10%%)")
    p.add_argument("--replay", action="store_true", help="replay every capture with mxscope replay")
    p.add_argument("--mxscope", default=None, help="the mxscope CLI (default: PATH, then build/)")
    p.add_argument("--replay-device", default="cpu", choices=("cpu", "gpu"))
    p.add_argument("--replay-threads", type=int, default=0)
    p.add_argument("--neighbours", type=int, default=1, help="ladder neighbours replayed on each side of a recipe")
    p.add_argument("--attribute", action="store_true", help="replay with --attribute (flush/clip/round shares)")
    p.add_argument("--replay-parallel", type=int, default=2,
                   help="replays run at once, each as soon as its capture run has finished (overlapping training)")
    p.add_argument("--delete-captures", action="store_true", help="remove a capture once its replays are done")
    p.add_argument("--time-limit", type=float, default=0,
                   help="seconds: start no run that would end past it (by the median wall time of the runs "
                        "finished so far), stop what still runs at it, write the tables; rerun to go on (0: none)")
    p.add_argument("--replay-grace", type=float, default=0,
                   help="seconds past --time-limit that replays may still run (a capture does not outlive its "
                        "invocation's output unless it is kept, so its replays should finish in it)")
    p.add_argument("--analyze-only", action="store_true", help="skip training and replay; rewrite the tables")
    p.add_argument("--overheads-from", default=None, metavar="DIR",
                   help="take the overheads from DIR/evals.csv (another ablation) and use this directory's "
                        "replays only for metrics: metrics.csv, predictors*.csv and metrics_agreement.csv "
                        "(against DIR/metrics.csv); for replays added later, e.g. with --attribute")
    p.add_argument("--target-rule", choices=("mean", "max"), default="mean")
    p.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples of the overhead intervals")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: one run, options as JSON
    return p


def _worker(payload: str) -> int:
    data = json.loads(payload)
    data["capture_layers"] = tuple(data.get("capture_layers") or ())
    data["capture_windows"] = {k: tuple(v) for k, v in (data.get("capture_windows") or {}).items()}
    options = RunOptions(**data)
    rows = train_one(options)
    append_run(os.path.join(options.out, "evals.csv"), rows)
    return 0


def _provenance(out: str, argv: List[str], started: float, jobs: List[RunOptions], device: str) -> None:
    import torch
    path = os.path.join(out, "run.json")
    previous = {}
    if os.path.exists(path):
        with open(path) as handle:
            previous = json.load(handle)
    runs = dict(previous.get("runs", {}))
    for job in jobs:
        info_path = os.path.join(job.run_dir, "run.json")
        if os.path.exists(info_path):
            with open(info_path) as handle:
                info = json.load(handle)
            runs["/".join(str(k) for k in job.key)] = {k: info.get(k) for k in
                                                        ("wall_s", "device", "parameters", "tokens_per_step",
                                                         "torch", "divergence", "stopped", "host")}
    cuda = torch.cuda.is_available()
    record = {
        "hardware": {"host": socket.gethostname(), "machine": platform.machine(), "cpus": os.cpu_count(),
                     "gpu": torch.cuda.get_device_name(0) if cuda else None, "device": device},
        "software": {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
                     "platform": platform.platform()},
        "invocations": previous.get("invocations", []) + [{
            "command": shlex.join(argv), "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
            "wall_s": round(time.time() - started, 3), "runs_trained": ["/".join(str(k) for k in j.key) for j in jobs]}],
        "runs": runs,
    }
    _atomic_write(path, json.dumps(record, indent=1, default=str) + "\n")


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.worker is not None:
        return _worker(args.worker)
    started = time.time()
    os.makedirs(args.out, exist_ok=True)
    sizes = dict(SIZES)
    sizes.update(dict(args.size))
    size_names = parse_list(args.sizes)
    for name in size_names:
        if name not in sizes:
            raise SystemExit(f"unknown size {name!r}; presets {sorted(SIZES)} or define it with --size")
    recipes = list(LADDER) if args.recipes == "ladder" else parse_list(args.recipes)
    seeds = [int(s) for s in parse_list(args.seeds)]
    if not args.analyze_only:
        check_recipes(recipes)
    capture_seeds = set(int(s) for s in parse_list(args.capture_seeds)) if args.capture_seeds else {seeds[0]}
    evals_path = os.path.join(args.out, "evals.csv")
    log = lambda text: print(text, flush=True)  # noqa: E731

    jobs: List[RunOptions] = []
    if not args.analyze_only:
        done = completed_runs(evals_path)
        threads = args.threads or max(1, (os.cpu_count() or 1) // max(1, args.parallel))
        for size in size_names:
            config = sizes[size]
            log(f"size {size}: {config}, {parameter_count(config):,} parameters (TinyLlama count)")
            layers = (tuple(int(v) for v in parse_list(args.capture_layers)) if args.capture_layers
                      else default_capture_layers(config["layers"]))
            windows = capture_windows(args.steps, args.capture_window, args.capture_early)
            for recipe in recipes:
                for seed in seeds:
                    options = RunOptions(
                        out=args.out, size=size, size_config=config, recipe=recipe, seed=seed, steps=args.steps,
                        eval_every=args.eval_every, overrun=args.overrun, eval_batches=args.eval_batches, lr=args.lr, warmup=args.warmup,
                        weight_decay=args.weight_decay, model=args.model, device=args.device,
                        max_corpus_bytes=args.max_corpus_bytes, threads=threads,
                        capture=args.capture and seed in capture_seeds, capture_layers=layers,
                        capture_windows=windows)
                    if options.key in done:
                        log(f"skip {size}/{recipe}/seed{seed}: complete in evals.csv")
                        continue
                    jobs.append(options)
        jobs = order_jobs(jobs)
        deadline = started + args.time_limit if args.time_limit > 0 else None
        replay_deadline = deadline + args.replay_grace if deadline is not None else None
        replays = ReplayQueue(args, recipes, capture_seeds, log, replay_deadline) if args.replay else None
        if replays is not None:  # captures of runs finished by an earlier invocation
            for size in size_names:
                for recipe in recipes:
                    for seed in sorted(capture_seeds):
                        if (size, recipe, seed) in done:
                            replays.submit(size, recipe, seed)
        try:
            left = _train_all(jobs, args.parallel, evals_path, log, deadline=deadline,
                              on_finished=(lambda job: replays.submit(job.size, job.recipe, job.seed))
                              if replays is not None else None)
        finally:  # a failed run still leaves the provenance of the runs that finished
            _provenance(args.out, ["tools/ablate"] + argv, started, jobs, args.device)
            if replays is not None:
                replays.finish()
        if left or (replays is not None and replays.unfinished):
            log(f"time limit: {len(left)} run(s) and {len(replays.unfinished) if replays else 0} replay(s) left "
                f"for the next invocation of the same command")

    analyze(args.out, target_rule=args.target_rule, n_boot=args.bootstrap, plot=not args.no_plot, log=log,
            overheads_from=args.overheads_from)
    written = ([] if args.overheads_from else ["runs.csv", "overhead.csv"]) + \
        [name for name in ("metrics.csv", "predictors.csv", "metrics_agreement.csv")
         if os.path.exists(os.path.join(args.out, name))]
    log(f"wrote in {args.out}: {', '.join(written) if written else 'nothing'}")
    return 0


def order_jobs(jobs: List[RunOptions]) -> List[RunOptions]:
    """Capturing runs first (their replays then overlap the other runs' training), then seed-major
    (every recipe's first seed before any second seed, so that a stopped invocation leaves whole
    seeds), and within a seed the slower recipes first (stochastic rounding, random
    signs and NVFP4 take the longest), so that the last runs to start are short ones."""
    def cost(recipe: str) -> int:
        return -sum(part in recipe for part in ("sr", "rht", "nvfp4", "fixed", "all"))
    seeds = sorted({j.seed for j in jobs})
    return sorted(jobs, key=lambda j: (not j.capture, seeds.index(j.seed), cost(j.recipe)))


class ReplayQueue:
    """Replays of finished capture runs, --replay-parallel at a time on background threads, so that
    they overlap the training of the other runs. bf16's capture is replayed under every recipe (the
    off-policy comparison); every other capture under its own recipe and its ladder neighbours."""

    def __init__(self, args, recipes: Sequence[str], capture_seeds, log, deadline: Optional[float]):
        import concurrent.futures
        self.args, self.recipes, self.capture_seeds, self.log, self.deadline = args, list(recipes), capture_seeds, log, deadline
        self.mxscope = find_mxscope(args.mxscope)
        if self.mxscope is None:
            raise SystemExit("--replay: no mxscope CLI (give --mxscope PATH, put it on PATH, or build it)")
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.replay_parallel))
        self.futures = {}
        self.unfinished: List[str] = []

    def submit(self, size: str, recipe: str, seed: int) -> None:
        if seed not in self.capture_seeds:
            return
        run_dir = os.path.join(self.args.out, "runs", size, recipe, f"seed{seed}")
        if not os.path.isdir(os.path.join(run_dir, "capture")):
            if not os.path.isdir(os.path.join(run_dir, "replay")):
                self.log(f"no capture in {run_dir}: not replayed (it was trained without --capture)")
            return
        self.futures[run_dir] = self.pool.submit(self._replay, run_dir, recipe, seed)

    def _replay(self, run_dir: str, recipe: str, seed: int) -> None:
        if self.deadline is not None and time.time() >= self.deadline:
            raise subprocess.TimeoutExpired("replay", 0)
        names = ([recipe] + [r for r in self.recipes if r != recipe]) if recipe == "bf16" else \
            strategies.neighbours(self.recipes, recipe, self.args.neighbours)
        windows = capture_windows(self.args.steps, self.args.capture_window, self.args.capture_early)
        replay_run(run_dir, recipe, seed, names, windows, self.mxscope, self.args.replay_device,
                   self.args.replay_threads, self.args.attribute, self.log, deadline=self.deadline)
        if self.args.delete_captures:
            shutil.rmtree(os.path.join(run_dir, "capture"), ignore_errors=True)

    def finish(self) -> None:
        """Wait for every replay; those stopped by the deadline are listed in `unfinished`."""
        failures = []
        for run_dir, future in self.futures.items():
            try:
                future.result()
            except subprocess.TimeoutExpired:
                self.unfinished.append(run_dir)
            except subprocess.CalledProcessError as error:
                failures.append(f"{run_dir}: {error}")
        self.pool.shutdown()
        if failures:
            raise SystemExit("replays failed: " + "; ".join(failures))


def _train_all(jobs: List[RunOptions], parallel: int, evals_path: str, log, deadline: Optional[float] = None,
               on_finished=None) -> List[RunOptions]:
    """Train the jobs, in this process (parallel 1) or as `parallel` concurrent subprocesses, calling
    on_finished(job) after each successful run. With a deadline no run starts that would end past
    it by the median wall time of the runs finished so far, and runs still going at it are stopped
    (they are trained again by the next invocation). Returns the jobs not trained."""
    def too_late(walls: List[float]) -> bool:
        if deadline is None:
            return False
        typical = sorted(walls)[len(walls) // 2] if walls else 0.0
        return time.time() + typical >= deadline

    walls: List[float] = []
    if parallel <= 1:
        for index, job in enumerate(jobs):
            if too_late(walls):
                return jobs[index:]
            log(f"train {job.size}/{job.recipe}/seed{job.seed}")
            begun = time.time()
            append_run(evals_path, train_one(job))
            walls.append(time.time() - begun)
            if on_finished is not None:
                on_finished(job)
        return []
    env = dict(os.environ)
    env["PYTHONPATH"] = PYTHON_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    pending = list(jobs)
    running: List[Tuple[subprocess.Popen, RunOptions, object, float]] = []
    failures, stopped = [], []
    while pending or running:
        while pending and len(running) < parallel and not too_late(walls):
            job = pending.pop(0)
            os.makedirs(job.run_dir, exist_ok=True)
            logfile = open(os.path.join(job.run_dir, "log.txt"), "w")
            payload = json.dumps(asdict(job))
            process = subprocess.Popen([sys.executable, "-m", "mxscope.ablate.runner", "--out", job.out,
                                        "--worker", payload], env=env, stdout=logfile, stderr=subprocess.STDOUT)
            log(f"train {job.size}/{job.recipe}/seed{job.seed} (pid {process.pid})")
            running.append((process, job, logfile, time.time()))
        if not running:
            break  # the deadline leaves no room for the pending runs
        time.sleep(0.2)
        late = deadline is not None and time.time() >= deadline
        for item in list(running):
            process, job, logfile, begun = item
            if late and process.poll() is None:
                process.kill()
                process.wait()
                stopped.append(job)
                log(f"stopped {job.size}/{job.recipe}/seed{job.seed} at the time limit")
            if process.poll() is not None:
                logfile.close()
                running.remove(item)
                if job in stopped:
                    continue
                if process.returncode != 0:
                    failures.append(f"{job.size}/{job.recipe}/seed{job.seed} (exit {process.returncode}, "
                                    f"see {job.run_dir}/log.txt)")
                else:
                    walls.append(time.time() - begun)
                    if on_finished is not None:
                        on_finished(job)
    if failures:
        raise SystemExit("runs failed: " + "; ".join(failures))
    return stopped + pending


if __name__ == "__main__":
    sys.exit(main())
