"""moetrace: what does the kernel do with MoE expert weights served from the page cache?"""

__version__ = "0.1.0"
