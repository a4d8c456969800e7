"""NVIDIA Dynamo's request hints, as kvtier hints (Dynamo 1.6.1).

Dynamo's frontend reads two per-request extensions (``nvext``) that say
something about the KV a request writes:

- ``nvext.agent_hints``: ``priority`` (forwarded to the engine),
  ``speculative_prefill`` (after the reply, Dynamo prefills the predicted
  next turn: this conversation's prefix is read again), ``osl`` (expected
  output length) and ``latency_sensitivity`` (seconds of router-queue
  priority);
- ``nvext.cache_control``: ``{"type": "ephemeral", "ttl": "1h"}``; the
  router then calls the serving worker's ``pin_prefix(token_ids, ttl)``.

The engine connectors read kvtier hints from a request's
``kv_transfer_params`` (``kvtier_*``) or from a ``kv_hints`` action of type
``kvtier.hints`` (docs/OPERATIONS.md, "Hints and prefetch per engine").
:func:`hints_payload` turns a request's ``nvext`` into that payload, for
the worker-side code that builds the engine request;
:func:`transfer_params` gives the ``kvtier_``-prefixed form, and
:func:`pin_prefix` is the body of a ``pin_prefix`` handler.

What each Dynamo field becomes:

- ``priority`` -> ``priority`` (kvtier: 0-255, higher is kept longer).
  Engines disagree on the direction (vLLM and SGLang with
  ``--schedule-low-priority-values-first`` run lower values first), so the
  caller says which: ``priority_order="higher_first"`` (Dynamo's documented
  default) clamps the value to 0-255, ``"lower_first"`` maps ``p`` to
  ``-p`` clamped (the engine's default 0 stays 0).
- ``speculative_prefill: true`` -> ``expected_reuse`` at least 1.
- ``cache_control`` -> ``pinned`` (the TTL is :func:`pin_prefix`'s).
- ``reasoning=True`` with ``prompt_tokens`` -> ``ephemeral_from_token``:
  the chat template strips thinking from earlier turns, so the decode
  blocks of a reasoning model are never the prefix of the next request.
- ``osl`` and ``latency_sensitivity`` are not used: one sizes decode-side
  KV in the router, the other orders the router's queue; neither says
  whether a block is read again.

A malformed hint raises ``ValueError`` naming the field; the connectors
ignore and count a bad hint (``hint_errors``), never failing a request.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import kvtier

from ._common import PRIORITY_MAX

__all__ = ["hints_payload", "transfer_params", "ttl_seconds", "pin_prefix", "TTL_MIN_S", "TTL_MAX_S"]

# Dynamo clamps a cache_control TTL to [300, 3600] s and reads anything it
# does not recognise as 300 s; kvtier pins for the same time.
TTL_MIN_S = 300
TTL_MAX_S = 3600

_TTL = re.compile(r"^\s*(\d+)\s*([smh]?)\s*$")
_UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600}


def ttl_seconds(ttl: Any) -> int:
    """A ``cache_control.ttl`` as Dynamo reads it: integer seconds
    (``"600"``, ``600``) or ``"5m"`` / ``"1h"``, clamped to 300-3600 s;
    anything else is 300 s."""
    if isinstance(ttl, bool):
        return TTL_MIN_S
    if isinstance(ttl, int):
        secs = ttl
    else:
        m = _TTL.match(ttl) if isinstance(ttl, str) else None
        if m is None:
            return TTL_MIN_S
        secs = int(m.group(1)) * _UNIT_S[m.group(2)]
    return min(max(secs, TTL_MIN_S), TTL_MAX_S)


def _section(nvext: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    v = nvext.get(name)
    if v is None:
        return {}
    if not isinstance(v, Mapping):
        raise ValueError(f"nvext.{name} must be an object, got {v!r}")
    return v


def hints_payload(
    nvext: Optional[Mapping[str, Any]],
    *,
    prompt_tokens: Optional[int] = None,
    reasoning: bool = False,
    priority_order: str = "higher_first",
) -> dict:
    """The ``kvtier.hints`` payload for a request with this ``nvext``
    (names without the ``kvtier_`` prefix; empty when nothing applies)."""
    if priority_order not in ("higher_first", "lower_first"):
        raise ValueError(f"priority_order must be 'higher_first' or 'lower_first', got {priority_order!r}")
    if not nvext:
        return {}
    if not isinstance(nvext, Mapping):
        raise ValueError(f"nvext must be an object, got {nvext!r}")
    hints = _section(nvext, "agent_hints")
    out: dict = {}
    p = hints.get("priority")
    if p is not None:
        if isinstance(p, bool) or not isinstance(p, (int, float)):
            raise ValueError(f"nvext.agent_hints.priority must be a number, got {p!r}")
        p = int(p) if priority_order == "higher_first" else -int(p)
        out["priority"] = min(max(p, 0), PRIORITY_MAX)
    spec = hints.get("speculative_prefill")
    if spec is not None:
        if not isinstance(spec, bool):
            raise ValueError(f"nvext.agent_hints.speculative_prefill must be true or false, got {spec!r}")
        if spec:
            out["expected_reuse"] = 1
    cc = _section(nvext, "cache_control")
    if cc:
        kind = cc.get("type", "ephemeral")
        if kind != "ephemeral":
            raise ValueError(f"nvext.cache_control.type must be 'ephemeral' (Dynamo's only type), got {kind!r}")
        out["pinned"] = True
    if reasoning and prompt_tokens is not None:
        if isinstance(prompt_tokens, bool) or not isinstance(prompt_tokens, int) or prompt_tokens < 0:
            raise ValueError(f"prompt_tokens must be an integer >= 0, got {prompt_tokens!r}")
        out["ephemeral_from_token"] = prompt_tokens
    return out


def transfer_params(nvext: Optional[Mapping[str, Any]], **kwargs: Any) -> dict:
    """:func:`hints_payload` as ``kv_transfer_params`` entries
    (``kvtier_priority``, ...), to merge into the engine request's."""
    return {f"kvtier_{k}": v for k, v in hints_payload(nvext, **kwargs).items()}


def pin_prefix(
    client: kvtier.Client,
    ns: kvtier.Namespace,
    token_ids: Sequence[int],
    ttl: Any = "5m",
) -> dict:
    """Dynamo's ``pin_prefix(token_ids, ttl)`` on kvtier: pins the full
    blocks of ``token_ids`` for :func:`ttl_seconds` (``ttl``); kvtierd
    first brings a block only a peer or G4 holds onto G3 (a pin is a G3
    pin). With ``hash_mode="dynamo"`` the keys are the router's sequence
    hashes. Answers like the SGLang worker's handler, ``{"status": "ok",
    "nodes_pinned": N, "absent": A, "limited": L, "ttl_s": S}`` (``limited``:
    the pin budget or this uid's share is spent); a dead daemon is
    ``{"status": "error", "message": ...}``, never an exception (the router
    fires and forgets, and a pin is an optimisation)."""
    secs = ttl_seconds(ttl)
    try:
        keys = ns.hash_chain(token_ids)
        got = client.pin(ns, keys, ttl_ms=secs * 1000) if keys else []
    except Exception as e:
        return {"status": "error", "message": f"kvtier pin_prefix failed: {e}"}
    return {
        "status": "ok",
        "nodes_pinned": got.count("ok"),
        "absent": got.count("absent"),
        "limited": got.count("limit_reached"),
        "ttl_s": secs,
    }
