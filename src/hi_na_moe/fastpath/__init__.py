"""The scope="all" engine: dense linears, norms, routers, attention, latent attention, gated MLPs,
decoder layers and stacks on the native kernels (orchestrate.py patches them in order). Imports
only core."""
