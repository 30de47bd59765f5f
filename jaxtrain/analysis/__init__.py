"""Reading a compiled program: per-device memory (``memory``), collectives from the HLO
(``collectives``), the mesh x rule-set planner (``plan``) and one candidate in detail (``explain``)."""
