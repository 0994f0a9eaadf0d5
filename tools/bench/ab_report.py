"""The report table of tools/bench/gpu-ab and tools/bench/step-ab: per label, each variant's
median, range and number of samples, the ratio of its median to the first variant's, and in how
many runs it was lower than the first variant's run of the same round (samples paired in the
order they were taken, where both have as many): a small difference that holds in most rounds
shows there even when the ranges overlap."""
import os
import statistics


def round_order(variants, round_index, fixed=False):
    """The variants in the order round round_index (from 1) runs them: rotated by one place a
    round (A B C, B C A, C A B, ...), so that each holds each place in turn and a cost of the
    place (the first run after the previous round's last, or after start-up) falls on all of them;
    with fixed, A B C every round."""
    if fixed or not variants:
        return list(variants)
    shift = (round_index - 1) % len(variants)
    return list(variants[shift:]) + list(variants[:shift])


def median_table(names, samples, unit, digits, label_filter=""):
    """Lines of the table. names: the variants in order, the first the baseline; samples:
    {name: {label: [value, ...]}}; labels in the order they first appear."""
    labels = []
    for name in names:
        for label in samples[name]:
            if label not in labels and label_filter in label:
                labels.append(label)
    base = names[0]
    lines = []
    for label in labels:
        lines.append(label)
        base_values = samples[base].get(label)
        base_median = statistics.median(base_values) if base_values else None
        for name in names:
            values = samples[name].get(label)
            if not values:
                lines.append(f"  {name:<16} (no figure)")
                continue
            median = statistics.median(values)
            ratio = f"{median / base_median:.3f}x {base}" if base_median else "-"
            paired = ""
            if name != base and base_values and len(values) == len(base_values):
                lower = sum(value < base_value for value, base_value in zip(values, base_values))
                paired = f"  lower in {lower} of {len(values)} paired"
            lines.append(f"  {name:<16} {median:10.{digits}f} {unit}  ({min(values):.{digits}f} .. {max(values):.{digits}f}, "
                         f"{len(values)} samples)  {ratio}{paired}")
    return lines


def variants_of(specs, program_of=lambda path: path):
    """[(name, program)] from NAME=PATH arguments (at least two, names distinct); program_of maps a
    PATH to the executable to run. Raises ValueError naming the bad argument."""
    variants = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"variant {spec!r}: expected NAME=PATH")
        if any(name == known for known, _ in variants):
            raise ValueError(f"variant {spec!r}: the name {name!r} is given twice")
        program = program_of(path)
        if not (os.path.isfile(program) and os.access(program, os.X_OK)):
            raise ValueError(f"variant {name}: {program} is not an executable file")
        variants.append((name, program))
    if len(variants) < 2:
        raise ValueError("give at least two variants (NAME=PATH), the first being the baseline")
    return variants
