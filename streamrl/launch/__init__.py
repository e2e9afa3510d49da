"""`streamrl launch`: plan a job (plan.py, pure), run it on this host (local.py) or on a Ray cluster
(ray.py) under one supervisor (supervisor.py), show progress (view.py), write the run folder (run.py).

Nothing is imported here, so `import streamrl.launch.plan` stays light and Ray stays optional.
"""
