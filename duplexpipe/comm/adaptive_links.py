"""Adaptive stage sends: the codec of each directed stage link chosen at run time (`p2p_compression="adaptive"`),
moved along a ladder of stage-send codecs from the link's measured exposure, alike on both ends of the link."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from duplexpipe.comm.adaptive import CompressionReport, Controller, Decision
from duplexpipe.comm.adaptive_agreement import LAG, Agreement
from duplexpipe.comm.codec import Codec, IdentityCodec, codec_name
from duplexpipe.comm.reduction import WaitFn
from duplexpipe.dp_options.compression import AdaptiveOptions


def link_key(src: int, dst: int) -> str:
    """The controller's key of the directed link from pipeline rank `src` to `dst`."""
    return f"link {src}->{dst}"


class LinkRungs:
    """The rung of each directed link (pipeline ranks), shared by a rank's activation and gradient codecs and
    changed only between steps (so both ends of a link use the same rung for a whole step)."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.rungs: dict[tuple[int, int], int] = {}

    def rung(self, src: int, dst: int) -> int:
        """The rung of link src -> dst now."""
        return self.rungs.get((src, dst), self.start)


class AdaptiveCodec(IdentityCodec):
    """One direction's stage-send codecs of the ladder's rungs (None: as computed), chosen per link by `for_link`.
    Used as a Codec on its own it sends a tensor as it is (IdentityCodec's methods), yet it is no pass-through: the
    Mailroom asks `for_link` for each send and receive."""

    def __init__(self, options: AdaptiveOptions, rungs: Sequence[Codec | None], links: LinkRungs, slot: str) -> None:
        self.options = options
        self.rungs = list(rungs)
        self.links = links
        self.slot = slot

    @property
    def name(self) -> str:
        """"adaptive(<each rung's codec name>)": equal on every rank with the same ladder."""
        return f"adaptive({'/'.join(codec_name(c) for c in self.rungs)})"

    @property
    def sends_as_is(self) -> bool:
        """False: each link's rung decides."""
        return False

    def for_link(self, src: int, dst: int) -> Codec | None:
        """The codec of link src -> dst in the running step."""
        return self.rungs[self.links.rung(src, dst)]


def adaptive_pair(options: AdaptiveOptions, pairs: Sequence[tuple[Codec | None, Codec | None]]
                  ) -> tuple[AdaptiveCodec, AdaptiveCodec]:
    """The (activation, gradient) adaptive codecs of `options`, sharing one LinkRungs: `pairs` holds each rung's
    (activation, gradient) codecs (`p2p_codecs.p2p_codec_pair` builds them from `dp_options.p2p.ladder_labels`)."""
    links = LinkRungs(options.start_rung)
    return (AdaptiveCodec(options, [a for a, _ in pairs], links, "activations"),
            AdaptiveCodec(options, [g for _, g in pairs], links, "gradients"))


class LinkAdapter:
    """The controller of a pipeline's directed stage links: each rank measures its incoming links (the time its
    receives blocked), the pipeline group agrees (`Agreement`), and the moves change the shared LinkRungs."""

    def __init__(self, codec: AdaptiveCodec, links: Sequence[tuple[int, int]], group: Any,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.codec = codec
        self.links = sorted(set(links))
        self.controller = Controller(codec.options, [link_key(*link) for link in self.links], lag=LAG)
        self.agreement = Agreement(self.controller, group, "the pipeline's stage links", clock)

    def finish_step(self, exposed_s: Mapping[str, float], step_s: float, loss: float | None, device: torch.device,
                    wait: WaitFn) -> CompressionReport:
        """End a step: settle the last agreement (new rungs from the next step), post this step's link exposures;
        the step's report."""
        used = self.controller.choices()
        self.settle(wait)
        return self.agreement.post(exposed_s, step_s, loss, device, used)

    def settle(self, wait: WaitFn) -> list[Decision]:
        """Between steps: complete the last agreement, decide, set the links' new rungs; the moves."""
        moves = self.agreement.settle(wait)
        for link in self.links:
            self.codec.links.rungs[link] = self.controller.rung(link_key(*link))
        return moves

    def state_dict(self) -> dict[str, Any]:
        """The links' controller (rungs, run counters, guard: plain data) for a checkpoint. An agreement in flight
        is not kept: after a resume the first step decides nothing, on the saved rungs."""
        return {"links": [list(link) for link in self.links], "controller": self.controller.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore state_dict(): the controller, and the links' rungs from the next step on."""
        links = sorted(tuple(link) for link in state["links"])
        if links != self.links:
            raise ValueError(f"adaptive stage-link state is for links {links}, this pipeline has {self.links}")
        self.controller.load_state_dict(state["controller"])
        self.agreement.forget()
        for link in self.links:
            self.codec.links.rungs[link] = self.controller.rung(link_key(*link))

