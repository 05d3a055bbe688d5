"""sm80+ kernels (mma.sync, cp.async, ldmatrix): :class:`~hstu_cute.ampere.fwd.HstuForwardSm80`
and the dK/dV + dQ(+drab) backward pair of :mod:`hstu_cute.ampere.bwd`. They run on Ampere, Ada
and Hopper; the cubin is built for the arch named in the compile key (:mod:`hstu_cute.variants`)."""
