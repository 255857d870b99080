"""A device profile: what each part of the model costs on one kind of device, as JSON.

``portapipe profile CONFIG`` measures one (:mod:`.measure`); :func:`published` builds one from
published figures (H800). A profile holds, for the model shape it was made for:

- ``parts[option][part][phase]``: time of one part as ``fixed_s + per_unit_s * units`` (units:
  tokens of the micro-batch; routed rows received for ``experts``), phases F (forward), B
  (input gradient) and W (weight gradient), options ``off``, ``level0``, ``level1``;
- ``a2a[str(ep)]``, ``p2p``, ``allreduce[str(n)]``: communication as ``latency_s + per_byte_s *
  bytes`` (an all-to-all counts the bytes a rank sends to the others; an EP size the table lacks
  takes the nearest measured figure, and the planner says so; an empty table is refused where
  an all-to-all is to be priced);
- ``issue_s[str(ep)]``: what issuing one all-to-all costs the issuing thread;
- ``a2a_cpu[str(ep)]``, ``p2p_cpu``: processor time the process's other threads (a CPU
  backend's communication threads) spend per all-to-all (``fixed`` per call, ``per_unit`` per
  byte sent) and per point-to-point transfer at each end; on a host whose ranks share the
  processors this is demand beside the compute (zero where a device's engines move the bytes);
- ``a2a_lag[str(ranks)]``: on a host whose ranks share the processors, how long an exchange
  waits for its EP peers beyond its latency (``fixed`` + ``per_unit`` x the processor time the
  rank computed since the exchange it last waited for), measured with ``ranks`` ranks of the
  host computing at once: the same work takes each peer a different wall time there;
- ``p2p_crowded[str(ranks)]``: what a point-to-point transfer takes longer, on average, while
  the host's other ranks compute (``ranks`` of them in all, more than the processors);
- ``crowding[str(ranks)]``: on such a host, how much more processor time the parts take when
  ``ranks`` ranks share the processors (each is switched between ranks inside its parts and
  finds its caches cold) than when timed on an EP group that fits them; measured on a step of
  the config's layout;
- ``optimizer``: AdamW per parameter element, ``optimizer_tensor_s`` per parameter tensor (the
  update runs tensor by tensor); ``part_overhead_s``: the tape's own work per part
  call (F and B: graph cuts, gradient bookkeeping); ``post_s``: posting one batch of
  point-to-point transfers; ``action_s``: any further cost per executor action;
- ``processors``: compute units the ranks of one host share (measured on CPUs; null when every
  rank has a device of its own);
- ``saved_bytes[option][part]``: what the accounting measured (``fixed`` + ``per_unit``), beside
  what :mod:`.shape` predicts;
- ``loads``: expert loads (tokens per expert per layer) seen while profiling, for imbalance;
- ``host_link``: the host link's copies (``h2d``, ``d2h``: ``fixed`` + ``per_unit`` per byte) as the
  backend's offload copies run them, and ``host_overlap``: whether they run beside compute (a copy
  stream of their own, ``capabilities.host_copies: async``) or in line with it.

:meth:`Profile.for_shape` rescales a profile to another model shape by FLOP count per part and
phase (fixed costs unchanged): the way a shipped or published profile serves another model.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .shape import PARTS, PHASES, Shape, flops

FORMAT = 1
TIMED_OPTIONS = ("off", "level0", "level1")
# the parts whose work a memory option changes; every other part costs what it costs with ``off``
CHANGED_PARTS = {"level0": ("experts", "combine"), "level1": ("experts", "shared", "combine")}
#: a part a profile may lack (measured on a model without it) -> the measured part whose pace per
#: FLOP prices it: the multi-token prediction input is a norm and a projection, as attention's are;
#: a norm made again in the backward (memory.recompute: norms) moves data, as the combine does;
#: MLA's up-projection made again is the attention's GEMMs
BORROWED = {"mtp": "attention", "norms": "combine", "up_projection": "attention"}


class ProfileError(ValueError):
    """A profile file that cannot be used; the message says what is wrong."""


@dataclass
class Linear:
    """``fixed + per_unit * units``."""

    fixed: float = 0.0
    per_unit: float = 0.0

    def __call__(self, units: float) -> float:
        return self.fixed + self.per_unit * units

    @classmethod
    def fit(cls, samples: list[tuple[float, float]]) -> Linear:
        """Least squares through ``(units, value)`` samples; clamped to be non-negative.
        With one distinct unit count everything goes to ``per_unit``."""
        xs = [u for u, _ in samples]
        if not samples:
            return cls()
        n = len(samples)
        mx, my = sum(xs) / n, sum(v for _, v in samples) / n
        var = sum((x - mx) ** 2 for x in xs)
        if var <= 1e-12 * max(mx * mx, 1.0):
            return cls(0.0, my / mx if mx else 0.0)
        slope = sum((x - mx) * (v - my) for x, v in samples) / var
        slope = max(slope, 0.0)
        fixed = my - slope * mx
        if fixed < 0:  # no negative overhead: put it all in the slope through the mean
            return cls(0.0, my / mx if mx else 0.0)
        return cls(fixed, slope)


@dataclass
class Profile:
    device: dict[str, Any]
    torch: str
    shape: Shape
    parts: dict[str, dict[str, dict[str, Linear]]]
    a2a: dict[str, Linear]
    p2p: Linear
    allreduce: dict[str, Linear]
    optimizer: Linear
    optimizer_tensor_s: float = 0.0
    action_s: float = 0.0
    part_overhead_s: dict[str, float] = field(default_factory=lambda: {"F": 0.0, "B": 0.0})
    post_s: float = 0.0
    issue_s: dict[str, float] = field(default_factory=dict)  # issuing one all-to-all, per group size
    a2a_cpu: dict[str, Linear] = field(default_factory=dict)  # other threads' processor time per all-to-all
    p2p_cpu: Linear = field(default_factory=Linear)  # other threads' processor time per transfer end
    a2a_lag: dict[str, Linear] = field(default_factory=dict)  # waiting for EP peers, per ranks computing at once
    crowding: dict[str, float] = field(default_factory=dict)  # compute's processor time, per ranks sharing the processors
    p2p_crowded: dict[str, float] = field(default_factory=dict)  # a transfer's extra latency, per ranks sharing the processors
    processors: float | None = None
    saved_bytes: dict[str, dict[str, Linear]] = field(default_factory=dict)
    loads: list[list[float]] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    source: str = ""
    #: where the profile came from, for messages (``--profile FILE`` when read from one); not saved
    origin: str = field(default="", compare=False, repr=False)
    host_link: dict[str, Linear] = field(default_factory=dict)  # h2d / d2h copies (offload), per byte
    host_overlap: bool = False  # the copies run beside compute (their own stream)

    # ------------------------------------------------------------------ costs
    def time(self, part: str, phase: str, option: str, units: float) -> float:
        """Seconds of ``part`` in ``phase`` (F, B, W; BW = B + W) for ``units`` under ``option``."""
        if phase == "BW":
            return self.time(part, "B", option, units) + self.time(part, "W", option, units)
        if option not in self.parts or part not in CHANGED_PARTS.get(option, ()):
            option = "off"
        cost = self.parts[option].get(part, {}).get(phase)
        if cost is None and part in BORROWED:  # a profile of a model without the part: priced by FLOPs
            # at the pace measured for a part of the same kind of work
            like = self.parts[option].get(BORROWED[part], {}).get(phase)
            if like is not None and self.shape is not None:
                ratio = flops(self.shape, part, phase) / max(flops(self.shape, BORROWED[part], phase), 1e-30)
                cost = Linear(like.fixed, like.per_unit * ratio)
        if cost is None:
            return 0.0
        return cost(units) + self.part_overhead_s.get(phase, 0.0)

    def a2a_time(self, ep: int, nbytes: float) -> float:
        """An all-to-all over ``ep`` ranks in which this rank sends ``nbytes`` in all (its own
        share stays local). Measured group sizes are used as they are; another size takes
        the nearest measured one (a documented limit; :meth:`a2a_stand_in` says which)."""
        cost = _nearest(self.a2a, ep)
        return 0.0 if cost is None else cost(nbytes * (ep - 1) / ep)

    def named(self) -> str:
        """The profile as messages name it: its file, else what made it."""
        return self.origin or f"the profile ({self.source})"

    def check_a2a(self) -> None:
        """Raise :class:`ProfileError` where the ``a2a`` table is empty: every all-to-all would
        cost 0 s (a profile measured on one rank has none)."""
        if not self.a2a:
            raise ProfileError(f"{self.named()}: a2a is empty, so every all-to-all would cost 0 s; make the profile on at least "
                               "2 ranks (`portapipe profile CONFIG`) or use a published one (--profile h800)")

    def a2a_stand_in(self, ep: int) -> str | None:
        """How the all-to-all over ``ep`` ranks is priced when the ``a2a`` table has no figure of
        its own for it: which measured figure stands in (:meth:`a2a_time`: the nearest size),
        extrapolated beyond the measured sizes; None when it has one (or for one rank)."""
        if ep <= 1 or not self.a2a or str(ep) in self.a2a:
            return None
        sizes = sorted(int(k) for k in self.a2a)
        near = _nearest_size(self.a2a, ep)
        how = "extrapolated from" if ep < sizes[0] or ep > sizes[-1] else "taken from the nearest,"
        return f"{how} the {near}-device figure"

    def a2a_background(self, ep: int, nbytes: float) -> float:
        """Processor time other threads of the process spend on that all-to-all (nearest measured size)."""
        cost = _nearest(self.a2a_cpu, ep)
        return 0.0 if cost is None else cost(nbytes * (ep - 1) / ep)

    def lag(self, ranks: int) -> Linear | None:
        """How an exchange waits for its peers with ``ranks`` ranks of the host computing at once
        (the nearest measured count); None where the ranks do not share processors."""
        if self.processors is None:
            return None
        return _nearest(self.a2a_lag, max(ranks, 2))

    def crowded(self, ranks: int) -> float:
        """Factor on compute's processor time with ``ranks`` ranks on the host: 1 while they fit
        the processors, the measured factor at the measured rank count, linear in between (and
        no more beyond it)."""
        if self.processors is None or ranks <= self.processors or not self.crowding:
            return 1.0
        size = _nearest_size(self.crowding, ranks)
        if size <= self.processors:
            return 1.0
        return 1.0 + (self.crowding[str(size)] - 1.0) * min(1.0, (ranks - self.processors) / (size - self.processors))

    def p2p_extra(self, ranks: int) -> float:
        """What a transfer takes longer with ``ranks`` ranks on the host: nothing while they fit
        the processors, else the measured figure of the nearest rank count."""
        if self.processors is None or ranks <= self.processors:
            return 0.0
        got = _nearest(self.p2p_crowded, ranks)
        return 0.0 if got is None else got

    def issue_time(self, ep: int) -> float:
        """What issuing one all-to-all over ``ep`` ranks costs the caller (nearest measured size)."""
        got = _nearest(self.issue_s, ep)
        return 0.0 if got is None else got

    def host_copy_time(self, to_device: float, to_host: float) -> float:
        """Seconds of host-link copies of ``to_device`` and ``to_host`` bytes, one after the other
        (one copy stream): 0 where the profile has no host link."""
        out = 0.0
        for key, nbytes in (("h2d", to_device), ("d2h", to_host)):
            cost = self.host_link.get(key)
            if cost is not None and nbytes > 0:
                out += cost(nbytes)
        return out

    def allreduce_time(self, n: int, nbytes: float) -> float:
        cost = _nearest(self.allreduce, n)
        if cost is None:
            return 0.0
        nearest = _nearest_size(self.allreduce, n)
        # ring all-reduce moves 2(n-1)/n of the bytes; the fitted size's factor is divided out
        factor = (2 * (n - 1) / n) / (2 * (nearest - 1) / nearest)
        return cost.fixed + cost.per_unit * nbytes * factor

    # --------------------------------------------------------------- scaling
    def check_shape(self, shape: Shape) -> None:
        """Raise :class:`ProfileError` where scaling this profile to ``shape`` would price the wrong
        work: one measured with ``train.fp8`` and the other without (FP8 GEMMs run at another rate)."""
        if shape.fp8 != self.shape.fp8:
            made, want = ("with", "off") if self.shape.fp8 else ("without", "on")
            raise ProfileError(f"--profile: measured {made} train.fp8 ({self.source}), but this config has train.fp8 {want}; "
                               "make a profile of this config (`portapipe profile CONFIG`) or use a published one (--profile h800)")

    def for_shape(self, shape: Shape) -> Profile:
        """This profile for another model shape: per-unit times scaled by the FLOPs (bytes for
        data-moving parts) per unit of each part and phase; fixed costs, communication and
        the optimizer's per-element time unchanged. The same shape returns ``self``; one that
        :meth:`check_shape` refuses raises."""
        if shape == self.shape:
            return self
        self.check_shape(shape)
        parts: dict[str, dict[str, dict[str, Linear]]] = {}
        for option, table in self.parts.items():
            parts[option] = {}
            for part, phases in table.items():
                parts[option][part] = {}
                for phase, cost in phases.items():
                    old, new = flops(self.shape, part, phase), flops(shape, part, phase)
                    ratio = new / old if old > 0 else 1.0
                    parts[option][part][phase] = Linear(cost.fixed, cost.per_unit * ratio)
        return Profile(
            device=dict(self.device), torch=self.torch, shape=shape, parts=parts, a2a=self.a2a, p2p=self.p2p,
            allreduce=self.allreduce, optimizer=self.optimizer, optimizer_tensor_s=self.optimizer_tensor_s, action_s=self.action_s,
            part_overhead_s=dict(self.part_overhead_s), post_s=self.post_s, issue_s=dict(self.issue_s), a2a_cpu=self.a2a_cpu, p2p_cpu=self.p2p_cpu, a2a_lag=self.a2a_lag, crowding=dict(self.crowding), p2p_crowded=dict(self.p2p_crowded),
            processors=self.processors,
            saved_bytes={}, loads=self.loads, tokens=self.tokens, host_link=dict(self.host_link), host_overlap=self.host_overlap,
            source=f"{self.source}; scaled by FLOPs from shape {_short(self.shape)} to {_short(shape)}", origin=self.origin,
        )

    # ---------------------------------------------------------------------- io
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        del d["origin"]
        d["format"] = FORMAT
        return d

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def from_dict(cls, d: Any, where: str = "profile") -> Profile:
        if not isinstance(d, dict):
            raise ProfileError(f"{where}: expected a JSON object, got {type(d).__name__}")
        if d.get("format") != FORMAT:
            raise ProfileError(f"{where}: format {d.get('format')!r} is not {FORMAT}; make it again with `portapipe profile`")
        missing = [k for k in ("device", "torch", "shape", "parts", "a2a", "p2p", "allreduce", "optimizer") if k not in d]
        if missing:
            raise ProfileError(f"{where}: missing {', '.join(missing)}")
        try:
            shape = Shape(**d["shape"])
            parts = {
                opt: {part: {ph: _linear(c, f"{where}: parts.{opt}.{part}.{ph}") for ph, c in phases.items()} for part, phases in table.items()}
                for opt, table in d["parts"].items()
            }
            prof = cls(
                device=dict(d["device"]), torch=str(d["torch"]), shape=shape, parts=parts,
                a2a={str(k): _linear(v, f"{where}: a2a.{k}") for k, v in d["a2a"].items()},
                p2p=_linear(d["p2p"], f"{where}: p2p"),
                allreduce={str(k): _linear(v, f"{where}: allreduce.{k}") for k, v in d["allreduce"].items()},
                optimizer=_linear(d["optimizer"], f"{where}: optimizer"),
                optimizer_tensor_s=float(d.get("optimizer_tensor_s", 0.0)),
                action_s=float(d.get("action_s", 0.0)),
                part_overhead_s={str(k): float(v) for k, v in d.get("part_overhead_s", {"F": 0.0, "B": 0.0}).items()},
                post_s=float(d.get("post_s", 0.0)),
                issue_s={str(k): float(v) for k, v in d.get("issue_s", {}).items()},
                a2a_cpu={str(k): _linear(v, f"{where}: a2a_cpu.{k}") for k, v in d.get("a2a_cpu", {}).items()},
                p2p_cpu=_linear(d.get("p2p_cpu", {}), f"{where}: p2p_cpu"),
                a2a_lag={str(k): _linear(v, f"{where}: a2a_lag.{k}") for k, v in d.get("a2a_lag", {}).items()},
                crowding={str(k): float(v) for k, v in d.get("crowding", {}).items()},
                p2p_crowded={str(k): float(v) for k, v in d.get("p2p_crowded", {}).items()},
                processors=None if d.get("processors") is None else float(d["processors"]),
                saved_bytes={o: {p: _linear(c, f"{where}: saved_bytes.{o}.{p}") for p, c in t.items()} for o, t in d.get("saved_bytes", {}).items()},
                loads=[[float(x) for x in row] for row in d.get("loads", [])],
                tokens=[int(t) for t in d.get("tokens", [])],
                source=str(d.get("source", "")),
                host_link={str(k): _linear(v, f"{where}: host_link.{k}") for k, v in d.get("host_link", {}).items()},
                host_overlap=bool(d.get("host_overlap", False)),
            )
        except ProfileError:
            raise
        except (TypeError, ValueError, AttributeError, KeyError) as exc:
            raise ProfileError(f"{where}: malformed ({type(exc).__name__}: {exc})") from None
        if set(prof.host_link) - {"h2d", "d2h"}:
            raise ProfileError(f"{where}: host_link has {', '.join(sorted(set(prof.host_link) - {'h2d', 'd2h'}))}; known: h2d, d2h")
        if "off" not in prof.parts:
            raise ProfileError(f"{where}: parts has no 'off' entry (the times without memory options)")
        unknown = sorted({p for t in prof.parts.values() for p in t} - set(PARTS))
        if unknown:
            raise ProfileError(f"{where}: unknown parts {', '.join(unknown)}; known: {', '.join(PARTS)}")
        bad = sorted({ph for t in prof.parts.values() for phases in t.values() for ph in phases} - set(PHASES))
        if bad:
            raise ProfileError(f"{where}: unknown phases {', '.join(bad)}; known: {', '.join(PHASES)}")
        scalars = {"action_s": prof.action_s, "post_s": prof.post_s, "optimizer_tensor_s": prof.optimizer_tensor_s}
        scalars.update({f"issue_s.{k}": v for k, v in prof.issue_s.items()})
        scalars.update({f"part_overhead_s.{k}": v for k, v in prof.part_overhead_s.items()})
        scalars.update({f"p2p_crowded.{k}": v for k, v in prof.p2p_crowded.items()})
        bad_scalars = [k for k, v in scalars.items() if not v >= 0 or v == float("inf")]
        if bad_scalars:
            raise ProfileError(f"{where}: {', '.join(bad_scalars)} must be finite seconds >= 0")
        crowds = [k for k, v in prof.crowding.items() if not 1.0 <= v < float("inf") or not k.isdigit()]
        if crowds:
            raise ProfileError(f"{where}: crowding.{crowds[0]} must be a factor >= 1 keyed by a rank count")
        if prof.processors is not None and prof.processors <= 0:
            raise ProfileError(f"{where}: processors must be > 0 or null, got {prof.processors}")
        return prof

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        p = Path(path)
        if p.is_dir():
            raise ProfileError(f"--profile: {str(p)!r} is a folder; it takes a profile file (JSON: `portapipe profile CONFIG --out "
                               f"{p / 'profile.json'}` writes one) or a published device (h800)")
        if not p.is_file():
            raise ProfileError(f"--profile: {str(p)!r} does not exist (make one with `portapipe profile CONFIG --out {p}`)")
        try:
            data = json.loads(p.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ProfileError(f"--profile: {p} is not JSON: {exc}") from None
        prof = cls.from_dict(data, where=f"--profile {p}")
        prof.origin = f"--profile {p}"
        return prof


def _nearest_size(table: dict[str, Any], n: int) -> int:
    sizes = sorted(int(k) for k in table)
    return min(sizes, key=lambda k: (abs(k - n), -k))


def _nearest(table: dict[str, Any], n: int) -> Any:
    """The entry of a per-group-size table for ``n`` ranks (the nearest measured size; None
    for one rank or an empty table)."""
    if n <= 1 or not table:
        return None
    return table[str(_nearest_size(table, n))]


def _linear(v: Any, where: str) -> Linear:
    if not isinstance(v, dict) or set(v) - {"fixed", "per_unit"}:
        raise ProfileError(f"{where}: expected {{\"fixed\": seconds, \"per_unit\": seconds}}, got {v!r}")
    out = Linear(float(v.get("fixed", 0.0)), float(v.get("per_unit", 0.0)))
    if out.fixed < 0 or out.per_unit < 0 or out.fixed != out.fixed or out.per_unit != out.per_unit:
        raise ProfileError(f"{where}: costs must be finite and >= 0, got {v!r}")
    return out


def _short(s: Shape) -> str:
    return f"h{s.hidden}/w{s.moe_hidden}/E{s.n_experts}/k{s.top_k}/s{s.seq_len}/{s.dtype}"
