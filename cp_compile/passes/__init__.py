"""FX graph passes of the ``ring_cp`` backend (find attention, sequence-layout
propagation, rewrite, global reductions, outputs, grad sync), each ``(gm, ctx) -> gm``.

Empty until the backend lands (see DESIGN.md §3); nothing here is imported yet.
"""
