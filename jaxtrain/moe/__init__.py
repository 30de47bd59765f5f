"""Mixture-of-experts dispatch: routing each token copy to its experts and back, dropless or by capacity,
expert-parallel over the mesh (:mod:`.experts`). Not a kernel: the experts' grouped matmuls are the
kernel registry's (``model.grouped_matmul``); this room moves tokens between them."""
