"""sm90a kernels: TMA loads, WGMMA, a producer warp feeding consumer warpgroups through mbarrier
pipelines. The forward is :class:`~hstu_cute.hopper.fwd.HstuForwardSm90`; the backward is
:mod:`hstu_cute.hopper.bwd` (the fused D128 kernel and the dK/dV + dQ pair) and
:mod:`hstu_cute.hopper.bwd_wide` (D256 dK/dV/drab). Compile keys: :mod:`hstu_cute.variants`."""
