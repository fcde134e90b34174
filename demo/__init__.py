"""Demo code: tiny random-weight models and the demo data nodes the example workflows use.

Nothing in the product packages imports this package; the pack's ``__init__`` registers its nodes.
"""
