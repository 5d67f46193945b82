"""The engine contract: what the server, the fleet sync and the offline tools may use of an engine.

Two levels, as vLLM has them (an engine core that is stepped, a client that is not):

* ``EngineHandle``: an engine someone else steps. The server and the fleet sync hold one: the
  settings, the tokenizer, the adjacency matrix (``None`` when the engine has none: the fleet then
  has nothing to share), the load, health and shutdown. ``AsyncEngine`` (which steps its engine on a
  thread of its own) and ``Engine`` itself implement it.
* ``EngineCore``: a handle that is also stepped by its one caller: ``add_request``, ``abort``,
  ``step``, ``has_unfinished``. ``Engine`` implements it, in process or over a tensor-parallel
  runner (``tr_serve.tp.runner.tp_engine``: the same ``Engine``).

``RemoteRunner`` is the part of a model runner that lives outside this process (tensor-parallel
workers): the engine pings it in ``check_health`` and releases it in ``shutdown``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from tr_serve.engine.config import EngineConfig
    from tr_serve.engine.request import RequestOutput
    from tr_serve.engine.request_context import RequestContext
    from tr_serve.engine.scheduler import EngineLoad
    from tr_serve.sampling_params import SamplingParams
    from tr_serve.tr.matrix import AdjacencyMatrix
    from tr_serve.tr.tenant_rows import TenantMatrices


class EngineHandle(Protocol):
    """An engine as its owner sees it (it does not step it)."""

    config: "EngineConfig"
    tokenizer: Any

    @property
    def matrix(self) -> "AdjacencyMatrix | None":
        """The adjacency matrix the engine drafts from and recycles into, or None."""

    def abort(self, request_id: str) -> None:
        """Finish the request with ``abort``; unknown or finished ids are ignored."""

    def tenant_matrix_stats(self) -> dict[str, int] | None:
        """The named tenants' matrix overlays in total (tr/tenant_rows.py), None without a matrix."""

    def load(self) -> "EngineLoad":
        """Requests running, prefilling, waiting, and KV rows in use."""

    def check_health(self) -> None:
        """Raise when the engine cannot serve any more (its owner should be replaced)."""

    def shutdown(self) -> None:
        """Release what the engine holds outside this process; idempotent."""


class EngineCore(EngineHandle, Protocol):
    """An engine stepped by its one caller (``AsyncEngine``'s step thread, ``LLM.generate``)."""

    # the named tenants' matrix overlays (None without a matrix): what the fleet shares per tenant
    tenant_matrices: "TenantMatrices | None"
    runner: Any  # the model runner: start-up work (runner/startup_work.py) installs what it measured into it

    def add_request(self, prompt_ids: list[int], params: "SamplingParams", request_id: str | None = None,
                    namespace: str | None = None, context: "RequestContext | None" = None) -> str:
        """Queue a request (``context``: its tenant and switches); raises ValueError for one that
        can never be served."""

    def step(self) -> list["RequestOutput"]:
        """One forward: a prefill chunk, or one draft tree per running request."""

    def has_unfinished(self) -> bool:
        ...


@runtime_checkable
class RemoteRunner(Protocol):
    """A model runner whose workers live outside this process (``TPModelRunner``)."""

    def check_health(self) -> None:
        ...

    def shutdown(self) -> None:
        ...
