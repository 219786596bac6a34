"""Constants, options and size rounding of the simulated CUDA caching allocator.

The numbers mirror ``c10/cuda/CUDACachingAllocator.cpp`` and the option parser
(``c10/core/AllocatorConfig.cpp``). They are written out here from those rules,
not copied, and are pinned by ``tests/test_allocator.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from boom_ml.errors import InvalidInputError

MiB = 1 << 20

K_MIN_BLOCK_SIZE = 512  # every request is rounded up to a multiple of this
K_SMALL_SIZE = 1 * MiB  # largest request served from the small pool
K_SMALL_BUFFER = 2 * MiB  # segment size of the small pool (and its expandable page)
K_LARGE_BUFFER = 20 * MiB  # segment for 1-10 MiB requests (and the large expandable page)
K_MIN_LARGE_ALLOC = 10 * MiB  # from this size on a request gets its own segment
K_ROUND_LARGE = 2 * MiB  # such dedicated segments are rounded up to this

# roundup_power2_divisions holds one setting per power-of-two interval of the
# request size, from [1 MiB, 2 MiB) up to [32 GiB, 64 GiB) (sizes outside are
# clamped onto the first/last interval).
N_POW2_INTERVALS = 16
_POW2_FIRST_LOG2 = 20

# PyTorch refuses max_split_size_mb / max_non_split_rounding_mb below 20 (kLargeBuffer).
_MIN_SPLIT_MB = K_LARGE_BUFFER // MiB

# Keys PyTorch accepts that do not change device-memory behaviour in this model.
_IGNORED_BOOL_KEYS = {
    "release_lock_on_cudamalloc",
    "release_lock_on_hipmalloc",
    "pinned_use_cuda_host_register",
    "pinned_use_hip_host_register",
    "pinned_use_background_threads",
}
_IGNORED_VALUE_KEYS = {"pinned_num_register_threads", "pinned_reserve_segment_size_mb"}


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass(frozen=True)
class AllocatorConfig:
    """The ``PYTORCH_CUDA_ALLOC_CONF`` options that change how memory is carved.

    ``roundup_power2_divisions`` is either one int used for every size (0 = off)
    or a 16-tuple, one entry per power-of-two size interval starting at 1 MiB,
    which is what the bracket syntax ``[256:1,512:2,>:4]`` produces.
    ``max_non_split_rounding_mb`` (None = 20 MiB) is how much larger than the
    request an oversize cached block may be and still be handed out whole.
    """

    max_split_size_mb: float | None = None  # None = unlimited
    expandable_segments: bool = False
    roundup_power2_divisions: int | tuple[int, ...] = 0  # 0 = off
    max_non_split_rounding_mb: float | None = None

    def __post_init__(self) -> None:
        for name in ("max_split_size_mb", "max_non_split_rounding_mb"):
            value = getattr(self, name)
            if value is not None and value < _MIN_SPLIT_MB:
                raise InvalidInputError(
                    f"{name} must be >= {_MIN_SPLIT_MB} (PyTorch rejects smaller values), got {value}"
                )
        divs = self.roundup_power2_divisions
        values = divs if isinstance(divs, tuple) else (divs,)
        if isinstance(divs, tuple) and len(divs) != N_POW2_INTERVALS:
            raise InvalidInputError(
                f"roundup_power2_divisions tuple needs {N_POW2_INTERVALS} entries, got {len(divs)}"
            )
        for v in values:
            if v != 0 and not _is_pow2(v):
                raise InvalidInputError(
                    f"roundup_power2_divisions must be 0 or a power of 2, got {v}"
                )

    # -- derived values used by the simulator --------------------------------
    @property
    def max_split_size(self) -> int | None:
        """Bytes; None when unlimited."""
        if self.max_split_size_mb is None:
            return None
        return int(self.max_split_size_mb * MiB)

    @property
    def max_non_split_rounding(self) -> int:
        if self.max_non_split_rounding_mb is None:
            return K_LARGE_BUFFER
        return int(self.max_non_split_rounding_mb * MiB)

    def divisions_table(self) -> tuple[int, ...]:
        divs = self.roundup_power2_divisions
        if isinstance(divs, tuple):
            return divs
        return (divs,) * N_POW2_INTERVALS

    @classmethod
    def from_env_string(cls, text: str) -> AllocatorConfig:
        """Parse ``PYTORCH_CUDA_ALLOC_CONF`` syntax, e.g. ``"max_split_size_mb:128,expandable_segments:True"``.

        Keys PyTorch knows but that do not affect this model (pinned-memory and
        locking options, ``garbage_collection_threshold``) are validated and
        ignored; unknown keys and ``backend:cudaMallocAsync`` are errors.
        """
        tokens = _lex(text)
        kwargs: dict[str, object] = {}
        i = 0

        def expect(j: int, tok: str) -> None:
            if j >= len(tokens) or tokens[j] != tok:
                raise InvalidInputError(f"PYTORCH_CUDA_ALLOC_CONF {text!r}: expected {tok!r}")

        def value_at(j: int, key: str) -> str:
            if j >= len(tokens) or tokens[j] in ",:[]":
                raise InvalidInputError(
                    f"PYTORCH_CUDA_ALLOC_CONF {text!r}: missing value for {key}"
                )
            return tokens[j]

        while i < len(tokens):
            key = tokens[i]
            expect(i + 1, ":")
            i += 2
            if key in ("max_split_size_mb", "max_non_split_rounding_mb"):
                kwargs[key] = _parse_int(value_at(i, key), key)
            elif key == "expandable_segments":
                kwargs[key] = _parse_bool(value_at(i, key), key)
            elif key == "roundup_power2_divisions":
                if i < len(tokens) and tokens[i] == "[":
                    table, i = _parse_divisions_list(tokens, i, text)
                    kwargs[key] = table
                else:
                    v = _parse_int(value_at(i, key), key)
                    if not _is_pow2(v):
                        raise InvalidInputError(
                            f"roundup_power2_divisions must be a power of 2, got {v}"
                        )
                    kwargs[key] = v
            elif key == "garbage_collection_threshold":
                # Only acts together with a per-process memory fraction; not modelled.
                try:
                    gc = float(value_at(i, key))
                except ValueError as err:
                    raise InvalidInputError(f"{key}: not a number") from err
                if not 0.0 < gc < 1.0:
                    raise InvalidInputError(f"{key} must be in (0, 1), got {gc}")
            elif key == "backend":
                v = value_at(i, key)
                if v != "native":
                    raise InvalidInputError(
                        f"backend:{v} is not modelled (only the native caching allocator is)"
                    )
            elif key in _IGNORED_BOOL_KEYS:
                _parse_bool(value_at(i, key), key)
            elif key in _IGNORED_VALUE_KEYS:
                _parse_int(value_at(i, key), key)
            else:
                raise InvalidInputError(f"Unrecognized CachingAllocator option: {key}")
            i += 1
            if i < len(tokens):
                expect(i, ",")
                i += 1
        return cls(**kwargs)  # type: ignore[arg-type]


def _lex(text: str) -> list[str]:
    """Split on the separators PyTorch uses (, : [ ]) and drop spaces."""
    tokens: list[str] = []
    buf: list[str] = []
    for ch in text:
        if ch in ",:[]":
            if buf:
                tokens.append("".join(buf))
                buf.clear()
            tokens.append(ch)
        elif ch != " ":
            buf.append(ch)
    if buf:
        tokens.append("".join(buf))
    return tokens


def _parse_int(tok: str, key: str) -> int:
    try:
        return int(tok)
    except ValueError as err:
        raise InvalidInputError(f"{key}: expected an integer, got {tok!r}") from err


def _parse_bool(tok: str, key: str) -> bool:
    if tok not in ("True", "False"):
        raise InvalidInputError(f"{key}: expected True or False, got {tok!r}")
    return tok == "True"


def _parse_divisions_list(tokens: list[str], i: int, text: str) -> tuple[tuple[int, ...], int]:
    """Parse ``[256:1,512:2,>:4]`` starting at the ``[``; return (table, index of ``]``).

    Interval keys are sizes in MiB (powers of two). The first entry also fills every
    smaller interval; ``>`` fills from the previous entry's interval onward,
    overwriting that interval as well, which is what PyTorch's parser does.
    """
    table = [0] * N_POW2_INTERVALS
    first = True
    last_index = 0
    i += 1
    while i < len(tokens) and tokens[i] != "]":
        interval = tokens[i]
        if i + 2 >= len(tokens) or tokens[i + 1] != ":":
            raise InvalidInputError(
                f"PYTORCH_CUDA_ALLOC_CONF {text!r}: bad roundup_power2_divisions list"
            )
        val = _parse_int(tokens[i + 2], "roundup_power2_divisions")
        if val != 0 and not _is_pow2(val):
            raise InvalidInputError(
                f"roundup_power2_divisions must be 0 or a power of 2, got {val}"
            )
        if interval == ">":
            for j in range(last_index, N_POW2_INTERVALS):
                table[j] = val
        else:
            mb = _parse_int(interval, "roundup_power2_divisions interval")
            if not _is_pow2(mb):
                raise InvalidInputError(
                    f"roundup_power2_divisions interval must be a power of 2, got {mb}"
                )
            index = min(mb.bit_length() - 1, N_POW2_INTERVALS - 1)
            if first:
                for j in range(index):
                    table[j] = val
                first = False
            table[index] = val
            last_index = index
        i += 3
        if i < len(tokens) and tokens[i] == ",":
            i += 1
    if i >= len(tokens):
        raise InvalidInputError(f"PYTORCH_CUDA_ALLOC_CONF {text!r}: unterminated '['")
    return tuple(table), i


def roundup_power2_next_division(size: int, divisions: int) -> int:
    """Round ``size`` up to the next of ``divisions`` equal steps between two powers of two."""
    if size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    low = size & ~(step - 1)
    return size if low == size else low + step


def round_size(nbytes: int, divisions_table: tuple[int, ...] | None = None) -> int:
    """Bytes the allocator reserves for a request of ``nbytes`` (``round_size``)."""
    if nbytes < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    if divisions_table is not None:
        idx = nbytes.bit_length() - 1 - _POW2_FIRST_LOG2
        idx = 0 if idx < 0 else (N_POW2_INTERVALS - 1 if idx >= N_POW2_INTERVALS else idx)
        divs = divisions_table[idx]
        # Below 512 B per division the power-of-two steps would be finer than the
        # 512 B granularity, so PyTorch falls back to plain 512 B rounding.
        if divs > 1 and nbytes > K_MIN_BLOCK_SIZE * divs:
            return roundup_power2_next_division(nbytes, divs)
    return (nbytes + K_MIN_BLOCK_SIZE - 1) & ~(K_MIN_BLOCK_SIZE - 1)


def allocation_size(size: int) -> int:
    """Segment size cudaMalloc'd for a rounded request that found no cached block."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return (size + K_ROUND_LARGE - 1) // K_ROUND_LARGE * K_ROUND_LARGE
