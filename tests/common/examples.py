"""The examples run as shipped."""


from __future__ import annotations


import os


import subprocess


import sys


from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]


__all__ = ['Path', 'ROOT', 'os', 'subprocess', 'sys']
