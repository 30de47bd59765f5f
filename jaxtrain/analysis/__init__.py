"""Reading a compiled program: collectives from the HLO (``collectives``), the mesh x rule-set
planner (``plan``) and one candidate in detail (``explain``)."""
