"""The CPU kernels: C sources (``csrc/``, compiled on the machine that runs them by
:mod:`tr_serve.kernels.native`), their Python wrappers, and the start-up measurement that picks
among them (:mod:`tr_serve.kernels.kernel_autotune`). The runner calls them; the engine never knows
which kernels ran."""
