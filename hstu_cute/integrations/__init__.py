"""Drop-in entry points with other libraries' calling conventions and semantics.

* :mod:`hstu_cute.integrations.generative_recommenders`: ``hstu_mha`` as Meta's
  generative-recommenders defines it (docs/integrations.md).
* :mod:`hstu_cute.integrations.fbgemm`: FBGEMM's current ``hstu_attn_varlen_func`` and
  ``hstu_attn_qkvpacked_func`` (its parameter order, ``cu_seqlens_*`` / ``seqused_*`` names).
"""
