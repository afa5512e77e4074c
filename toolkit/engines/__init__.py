"""The engines moetrace records in place of its replay: llama.cpp from Debian sid, unpacked with
its own loader by the set-up (scripts/engine-setup.sh), never installed."""
