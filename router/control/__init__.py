"""The control plane: the cluster itself. The detached ClusterController (controller.py, with its
config, Ray-KV store, recovery, routers, nodes and reconcile loop), placement and node slots, the
cluster map, Ray nodes and router nodes, and launch (a whole cluster from one config). It imports
router.replica (the router actor it starts) and everything below; nothing in router imports it."""
