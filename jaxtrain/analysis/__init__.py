"""Reading runs and compiled programs before spending accelerator time: collectives from the HLO
(``collectives``), the mesh x rule-set planner (``plan``), one candidate in detail (``explain``) and
plots of runs (``report``). Each command's code and command line share one file."""
