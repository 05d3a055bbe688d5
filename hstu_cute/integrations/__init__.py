"""Drop-in entry points with other libraries' calling conventions and semantics.

* :mod:`hstu_cute.integrations.generative_recommenders`: ``hstu_mha`` as Meta's
  generative-recommenders defines it (docs/integrations.md).
"""
