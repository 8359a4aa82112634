"""One load run: the driver (``driver.py``) and the sinks it reads into (``cpu.py``, ``staged.py``)."""
