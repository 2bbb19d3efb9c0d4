"""Token lengths of a dataset, from a file: one length per line, or a histogram of ``length count`` lines.

The format is detected from the first data line and must hold for every line; ``#`` starts a comment. Every
problem is a one-line ``ValueError`` naming the file and the line.
"""

from __future__ import annotations

from pathlib import Path

FORMATS = {1: "one length per line", 2: "'length count' histogram"}


def read_lengths(path: str | Path) -> list[int]:
    """The token length of every sample in ``path`` (a histogram is expanded, in file order)."""
    name = str(path)
    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"lengths: no such file {name!r}")
    try:
        text = file.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"lengths: cannot read {name!r} as text ({err.__class__.__name__})") from None
    return parse_lengths(text, name)


def parse_lengths(text: str, name: str = "<lengths>") -> list[int]:
    lengths: list[int] = []
    width = None
    for line_number, raw in enumerate(text.splitlines(), 1):
        fields = raw.split("#", 1)[0].split()
        if not fields:
            continue
        where = f"lengths: {name} line {line_number}"
        if len(fields) not in FORMATS:
            raise ValueError(f"{where}: expected 'LENGTH' or 'LENGTH COUNT', got {raw.strip()!r}")
        if width is None:
            width = len(fields)
        elif len(fields) != width:
            raise ValueError(f"{where}: {len(fields)} field(s) in a file of {FORMATS[width]} "
                             f"(line {raw.strip()!r})")
        length = _integer(fields[0], where, "token length")
        count = _integer(fields[1], where, "count", minimum=0) if width == 2 else 1
        lengths.extend([length] * count)
    if not lengths:
        raise ValueError(f"lengths: {name} holds no lengths (one integer per line, or 'LENGTH COUNT' lines)")
    return lengths


def _integer(text: str, where: str, what: str, minimum: int = 1) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{where}: {what} {text!r} is not an integer") from None
    if value < minimum:
        raise ValueError(f"{where}: {what} must be >= {minimum}, got {value}")
    return value


def lognormal_lengths(mean: float, std: float, *, samples: int, minimum: int = 1, maximum: int | None = None
                      ) -> list[int]:
    """``samples`` token lengths of a lognormal with this mean and standard deviation, at evenly spaced quantiles
    (deterministic: the shape of the distribution, not one draw), clipped to ``[minimum, maximum]``, ascending.
    For a dataset published only as summary statistics (mean, std, min, max); the lognormal is an assumption."""
    import math
    from statistics import NormalDist

    if mean <= 0 or std <= 0 or samples < 1:
        raise ValueError(f"lengths: a lognormal needs mean > 0, std > 0 and samples >= 1, got {mean}, {std}, {samples}")
    sigma2 = math.log1p((std / mean) ** 2)
    normal = NormalDist(math.log(mean) - sigma2 / 2, math.sqrt(sigma2))
    top = maximum if maximum is not None else math.inf
    return [int(min(top, max(minimum, round(math.exp(normal.inv_cdf((i + 0.5) / samples))))))
            for i in range(samples)]
