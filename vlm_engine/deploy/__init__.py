"""Scale-out on Ray: Serve replicas of the whole server behind one endpoint, routed by cache
affinity (`ray_serve.py`, `routing.py`, `ray_router.py`). Ray is an optional dependency
(`pip install vlm-engine[ray]`); nothing here is imported unless `--ray` asks for it."""
