"""The replay strategy that reproduces a training recipe, and the analysis TOML for a capture.

A training recipe (mxscope.torch.Recipe) has one GemmRecipe, or None, per GEMM. The strategy that
replays it has the recipe's name and one per-GEMM table (analyses/README.md, "Schema") per GEMM:

  GemmRecipe field   strategy key (per-GEMM table)
  format             format                     (None GEMM: the capture precision, "bf16" under
                                                 bf16 autocast, "fp32" for the fp32 recipe)
  grad_format        a = { format = ... }       for dgrad and wgrad, whose operand A is dy
  grad_rounding      a = { rounding = ... }     likewise (with its seed_policy under sr)
  sr_bits            sr_bits                    only when not 32
  block (0=default)  block                      only when nonzero
  rounding           rounding                   only when not "rne"
  scale_rule         scale_rule                 only when not "floor"
  seed_policy        seed_policy                only with rounding "sr"
  rotation (0=none)  rotation = "hadamard:N"
  signs              signs                      only with a rotation and when not "none"
  Recipe.seed        seed (strategy level)      the Philox seed of SR and random signs, so the
                                                replay draws the training run's own streams

A GemmRecipe field outside this table with a non-trivial value is reported (unmapped_fields, a
comment in the analysis file, a warning from the runner): the replay would not reproduce it.

This module defines the mapping itself rather than calling Recipe.strategy_names(), so that it
works from the recipe fields alone (and for the two recipes the runner defines without
mxscope.torch, "bf16" and "fp32").
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Sequence

GEMMS = ("fprop", "dgrad", "wgrad")


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    text = str(value)
    if any(c in text for c in '"\\\n'):
        raise ValueError(f"unsupported character in TOML string {text!r}")
    return f'"{text}"'


#: The GemmRecipe fields this mapping translates; any other field with a non-trivial value is
#: reported by unmapped_fields (and written as a comment into the analysis), because the replay
#: would then not reproduce what the training ran.
MAPPED_FIELDS = ("format", "grad_format", "rounding", "grad_rounding", "scale_rule", "rotation", "signs",
                 "seed_policy", "block", "sr_bits")


def unmapped_fields(recipe_gemm) -> Dict[str, object]:
    """Fields of a GemmRecipe outside MAPPED_FIELDS whose value is not None, 0, False, "" or "none"."""
    if recipe_gemm is None:
        return {}
    if hasattr(recipe_gemm, "__dataclass_fields__"):
        names = list(recipe_gemm.__dataclass_fields__)
    else:
        names = [n for n in vars(recipe_gemm) if not n.startswith("_")]
    out = {}
    for name in names:
        value = getattr(recipe_gemm, name, None)
        if name not in MAPPED_FIELDS and value not in (None, 0, False, "", "none"):
            out[name] = value
    return out


def gemm_keys(gemm: str, recipe_gemm, unquantized_format: str = "bf16") -> Dict[str, object]:
    """Strategy keys of one GEMM of a recipe (module docstring); recipe_gemm None: unquantized."""
    if recipe_gemm is None:
        return {"format": unquantized_format}
    get = lambda name, default=None: getattr(recipe_gemm, name, default)  # noqa: E731
    keys: Dict[str, object] = {"format": get("format")}
    if get("block", 0):
        keys["block"] = int(get("block"))
    rounding = get("rounding", "rne") or "rne"
    if rounding != "rne":
        keys["rounding"] = rounding
    if (get("scale_rule", "floor") or "floor") != "floor":
        keys["scale_rule"] = get("scale_rule")
    if rounding == "sr" and get("seed_policy"):
        keys["seed_policy"] = get("seed_policy")
    rotation = get("rotation", 0) or 0
    if rotation:
        keys["rotation"] = f"hadamard:{int(rotation)}"
        signs = get("signs", "none") or "none"
        if signs != "none":
            keys["signs"] = signs
    if (get("sr_bits", 32) or 32) != 32:
        keys["sr_bits"] = int(get("sr_bits"))
    grad_format = get("grad_format")
    grad_rounding = get("grad_rounding")
    if gemm in ("dgrad", "wgrad") and (grad_format or grad_rounding):
        operand: Dict[str, object] = {"format": grad_format or get("format")}
        if grad_rounding:
            operand["rounding"] = grad_rounding
            if grad_rounding == "sr" and get("seed_policy"):
                operand["seed_policy"] = get("seed_policy")
        keys["a"] = operand
    return keys


def strategy_toml(name: str, recipe, seed: int = 0, unquantized_format: str = "bf16") -> str:
    """One [[strategy]] table replaying `recipe` (an object with .fprop, .dgrad, .wgrad, each a
    GemmRecipe or None; None itself means every GEMM unquantized)."""
    lines = ["[[strategy]]", f"name = {_toml_value(name)}", f"seed = {int(seed)}"]
    for gemm in GEMMS:
        recipe_gemm = getattr(recipe, gemm, None) if recipe is not None else None
        keys = gemm_keys(gemm, recipe_gemm, unquantized_format)
        extra = unmapped_fields(recipe_gemm)
        if extra:
            lines.append(f"# {gemm}: GemmRecipe fields without a replay key, not reproduced: "
                         + ", ".join(f"{k}={v!r}" for k, v in sorted(extra.items())))
        lines.append(f"{gemm} = {_toml_value(keys)}")
    return "\n".join(lines) + "\n"


def neighbours(ladder: Sequence[str], name: str, width: int = 1) -> List[str]:
    """The recipes within `width` places of `name` in the ladder order, `name` first."""
    if name not in ladder:
        return [name]
    i = list(ladder).index(name)
    out = [name]
    for d in range(1, width + 1):
        for j in (i - d, i + d):
            if 0 <= j < len(ladder):
                out.append(ladder[j])
    return out


def analysis_toml(strategies: Iterable[tuple], title: str, accumulation: str = "fp32-block",
                  attribute: bool = False) -> str:
    """An analysis file replaying fprop, dgrad and wgrad under the given strategies:
    strategies = [(name, recipe, seed, unquantized_format), ...]."""
    out = [f"name = {_toml_value(title)}",
           'description = "a training recipe and its ladder neighbours, replayed on the run\'s own capture"',
           'gemms = ["fprop", "dgrad", "wgrad"]', 'reference = "exact"',
           f"attribute = {_toml_value(bool(attribute))}", "", "[defaults]",
           f"accumulation = {_toml_value(accumulation)}", ""]
    seen = set()
    for name, recipe, seed, unquantized in strategies:
        if name in seen:
            continue
        seen.add(name)
        out.append(strategy_toml(name, recipe, seed, unquantized))
    return "\n".join(out)
