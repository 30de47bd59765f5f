"""What a training process does around the train step: learning the job's shape (``job``), the watched
``jax.distributed`` start (``join``), peers watching each other and leaving together (``heartbeat``),
signals and the preemption grace (``signals``), agreeing on a stop (``agreement``), host allocator
tuning (``host_memory``), inline one-device CPU dispatch (``cpu_dispatch``), XLA flags
(``xla_flags``), on/off environment variables (``env``) and the hang watchdog (``watchdog``)."""
