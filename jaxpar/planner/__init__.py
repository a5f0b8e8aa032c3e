"""The automatic parallel planner: which layout to train a model with on a given cluster, and why.

    cluster.py  cluster descriptions (presets in clusters/*.yaml; `jaxpar plan calibrate`)
    layout.py   a candidate layout as config overrides; its plan on a device-less mesh
    memory.py   per-device memory by term
    comm.py     bytes per collective kind the step issues, and their time on the cluster's links
    timing.py   compute, communication and pipeline-bubble time: step time, tokens/s, MFU
    search.py   enumerate valid layouts (the config checks' reasons for the rest), rank them
"""
