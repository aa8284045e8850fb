"""When, and on which stream, the fused pipeline issues a batch's embedding lookup.

Owns ``LookupSchedule`` and ``resolve_lookup_schedule``, which map recpipe's flags
(``use_emb_lookup_stream``, ``embedding_lookup_after_opt``) and torchrec 1.9.2's
``TrainPipelineFusedSparseDist`` arguments (``emb_lookup_stream``,
``embedding_lookup_after_data_dist``) onto one schedule and refuse contradictory
combinations. Imports no recpipe module.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Dict, Optional, Tuple

__all__ = ["EMB_LOOKUP_STREAMS", "LookupIssuePoint", "LookupSchedule", "resolve_lookup_schedule"]

_WHO = "TrainPipelineFusedSparseDist"

EMB_LOOKUP_STREAMS: Tuple[str, ...] = ("new", "current", "data_dist")
"""torchrec's ``emb_lookup_stream`` values: a new stream, the stream current when the pipeline
is built (the default stream: no overlap), torchrec's data-dist stream (its default)."""

_RECPIPE_STREAM: Dict[bool, str] = {True: "new", False: "data_dist"}
"""recpipe's ``use_emb_lookup_stream`` as the ``emb_lookup_stream`` value it selects."""


class LookupIssuePoint(Enum):
    """Where in the schedule a batch's lookup and output all-to-all are issued."""

    AFTER_BACKWARD = "after_backward"
    """Batch i+1's lookup right after batch i's backward, before batch i's optimizer step
    (recpipe's ``embedding_lookup_after_opt=False``; torchrec has no equivalent)."""
    AFTER_OPTIMIZER = "after_optimizer"
    """Batch i+1's lookup right after batch i's optimizer step, before batch i+1's input dist
    (recpipe's ``embedding_lookup_after_opt=True``; torchrec's
    ``embedding_lookup_after_data_dist=False``, which issues it at the start of the next
    ``progress()``: the same point between the two steps' work)."""
    AFTER_DATA_DIST = "after_data_dist"
    """Batch i's lookup in its own step, after batch i+1's input dist has started (and batch
    i+2 was copied, unless ``enqueue_batch_after_forward``), right before batch i's forward
    (torchrec's ``embedding_lookup_after_data_dist=True``)."""


_RECPIPE_POINT: Dict[bool, LookupIssuePoint] = {
    True: LookupIssuePoint.AFTER_OPTIMIZER,
    False: LookupIssuePoint.AFTER_BACKWARD,
}
_TORCHREC_POINT: Dict[bool, LookupIssuePoint] = {
    True: LookupIssuePoint.AFTER_DATA_DIST,
    False: LookupIssuePoint.AFTER_OPTIMIZER,
}
_POINT_WORDS: Dict[LookupIssuePoint, str] = {
    LookupIssuePoint.AFTER_BACKWARD: "batch i+1's lookup right after batch i's backward, before its optimizer step",
    LookupIssuePoint.AFTER_OPTIMIZER: "batch i+1's lookup right after batch i's optimizer step",
    LookupIssuePoint.AFTER_DATA_DIST: "batch i's lookup in its own step, after batch i+1's input dist started",
}


@dataclass(frozen=True)
class LookupSchedule:
    """The resolved lookup schedule of a ``TrainPipelineFusedSparseDist``.

    Args:
        emb_lookup_stream (str): torchrec's stream value (:data:`EMB_LOOKUP_STREAMS`); on a
            device without streams (CPU) every value runs the lookup on the calling thread.
        issue_point (LookupIssuePoint): where a batch's lookup is issued.
    """

    emb_lookup_stream: str
    issue_point: LookupIssuePoint

    @property
    def use_emb_lookup_stream(self) -> bool:
        """recpipe's flag: the lookup runs on a dedicated stream (``emb_lookup_stream='new'``)."""
        return self.emb_lookup_stream == "new"

    @property
    def embedding_lookup_after_opt(self) -> bool:
        """recpipe's flag: the lookup is issued after the previous batch's optimizer step."""
        return self.issue_point is not LookupIssuePoint.AFTER_BACKWARD

    @property
    def embedding_lookup_after_data_dist(self) -> bool:
        """torchrec's flag: the lookup is issued after the next batch's input dist started."""
        return self.issue_point is LookupIssuePoint.AFTER_DATA_DIST


def _stream(use_emb_lookup_stream: Optional[bool], emb_lookup_stream: Optional[Any], who: str) -> str:
    if emb_lookup_stream is not None and (
        not isinstance(emb_lookup_stream, str) or emb_lookup_stream not in EMB_LOOKUP_STREAMS
    ):
        raise ValueError(
            f"{who}: emb_lookup_stream must be one of {list(EMB_LOOKUP_STREAMS)} (torchrec's values) or "
            f"None, got {type(emb_lookup_stream).__name__} {emb_lookup_stream!r}. recpipe's "
            "use_emb_lookup_stream=True is emb_lookup_stream='new' and use_emb_lookup_stream=False is "
            "'data_dist': pass one of these values, or use_emb_lookup_stream instead."
        )
    mine = None if use_emb_lookup_stream is None else _RECPIPE_STREAM[use_emb_lookup_stream]
    if emb_lookup_stream is None:
        return mine or "data_dist"
    if mine is not None and mine != emb_lookup_stream:
        raise ValueError(
            f"{who}: use_emb_lookup_stream={use_emb_lookup_stream} (the lookup on the {mine!r} stream) "
            f"contradicts emb_lookup_stream={emb_lookup_stream!r}. Pass only one of them: "
            f"emb_lookup_stream={emb_lookup_stream!r} alone, or use_emb_lookup_stream={use_emb_lookup_stream} "
            f"alone (= emb_lookup_stream={mine!r})."
        )
    return emb_lookup_stream


def _issue_point(
    embedding_lookup_after_opt: Optional[bool], embedding_lookup_after_data_dist: Optional[bool], who: str
) -> LookupIssuePoint:
    mine = None if embedding_lookup_after_opt is None else _RECPIPE_POINT[embedding_lookup_after_opt]
    theirs = None if embedding_lookup_after_data_dist is None else _TORCHREC_POINT[embedding_lookup_after_data_dist]
    if mine is not None and theirs is not None and mine is not theirs:
        raise ValueError(
            f"{who}: embedding_lookup_after_opt={embedding_lookup_after_opt} ({_POINT_WORDS[mine]}) "
            f"contradicts embedding_lookup_after_data_dist={embedding_lookup_after_data_dist} "
            f"({_POINT_WORDS[theirs]}). Pass only one of them: "
            f"embedding_lookup_after_data_dist={embedding_lookup_after_data_dist} alone, or "
            f"embedding_lookup_after_opt={embedding_lookup_after_opt} alone."
        )
    return theirs or mine or LookupIssuePoint.AFTER_OPTIMIZER


def resolve_lookup_schedule(
    *,
    use_emb_lookup_stream: Optional[bool],
    embedding_lookup_after_opt: Optional[bool],
    emb_lookup_stream: Optional[str],
    embedding_lookup_after_data_dist: Optional[bool],
    who: str = _WHO,
) -> LookupSchedule:
    """The schedule recpipe's and torchrec's arguments select (None: not given).

    Defaults (nothing given): the data-dist stream, batch i+1's lookup right after batch i's
    optimizer step: both libraries' defaults. A recpipe flag and its torchrec counterpart may
    both be given only when they agree (``use_emb_lookup_stream=True`` with ``'new'``,
    ``False`` with ``'data_dist'``; ``embedding_lookup_after_opt=True`` with
    ``embedding_lookup_after_data_dist=False``). ``who``: the pipeline class the error
    messages name.

    Returns:
        LookupSchedule: the stream and issue point.

    Raises:
        ValueError: ``emb_lookup_stream`` outside :data:`EMB_LOOKUP_STREAMS`, or a recpipe flag
            contradicting its torchrec counterpart (the message names both and the fix).
    """
    return LookupSchedule(
        emb_lookup_stream=_stream(use_emb_lookup_stream, emb_lookup_stream, who),
        issue_point=_issue_point(embedding_lookup_after_opt, embedding_lookup_after_data_dist, who),
    )
