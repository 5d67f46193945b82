"""The real ``MatrixActor`` in-process behind a stand-in for its Ray handle (no Ray): the sync tests'
actor. ``handle.method.remote(*args)`` runs the method at once; ``snapshot`` and ``corpus_snapshot``
hand their value over directly instead of through the object store."""

from __future__ import annotations

import concurrent.futures

from tr_serve.fleet.actor import MatrixActor


class _Ref:
    def __init__(self, value=None, error=None):
        self.value, self.error = value, error

    def future(self):
        f = concurrent.futures.Future()
        if self.error is not None:
            f.set_exception(self.error)
        else:
            f.set_result(self.value)
        return f


def _run_now(coro):
    try:
        coro.send(None)
    except StopIteration as e:
        return e.value
    raise RuntimeError("the actor method suspended")


class LocalActor:
    """A handle-like wrapper: ``handle.method.remote(*args)`` runs ``MatrixActor.method`` now."""

    def __init__(self, spec):
        self.impl = MatrixActor(spec)
        self.fail: Exception | None = None
        self.snapshot_calls = 0
        self.corpus_calls = 0
        self.corpus_override = None  # what corpus_snapshot hands out instead of the corpus (a bad object)

    def __getattr__(self, name):
        def remote(*args):
            if self.fail is not None:
                return _Ref(error=self.fail)
            if name == "snapshot":  # as MatrixActor.snapshot, with the object store left out
                self.snapshot_calls += 1
                return _Ref({"epoch": self.impl.epoch, "version": self.impl.version, "published_at": 0.0,
                             "ref": [_Ref(self.impl.state.cands.copy())]})
            if name == "tenant_snapshot":  # as MatrixActor.tenant_snapshot, likewise
                return _Ref({"epoch": self.impl.epoch, "tenant_version": self.impl.tenant_version,
                             "ref": [_Ref(self.impl.tenant_table())]})
            if name == "corpus_snapshot":  # as MatrixActor.corpus_snapshot, likewise
                self.corpus_calls += 1
                corpus = self.corpus_override if self.corpus_override is not None else self.impl.corpus.batch()
                return _Ref({"epoch": self.impl.epoch, "corpus_seq": self.impl.corpus.last_seq, "ref": [_Ref(corpus)]})
            return _Ref(_run_now(getattr(self.impl, name)(*args)))

        return _RemoteMethod(remote)


class _RemoteMethod:
    def __init__(self, fn):
        self.remote = fn
