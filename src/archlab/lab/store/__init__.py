"""The results store of a suite directory (``results.sqlite``).

* ``database`` - ``ResultStore`` (the connection, every read and write) and the claims' ``Heartbeat``
* ``schema``   - the SQL of every schema version and its migrations
* ``rows``     - the records read from and written to the tables
* ``claims``   - claim records and keys, and a run's displayed status
* ``owner``    - which process holds a claim and whether it still exists; workers die with their parent

Everything a caller needs is re-exported here: ``from archlab.lab.store import ResultStore``.
"""

from archlab.lab.store.database import *  # noqa: F401,F403
from archlab.lab.store.database import __all__  # noqa: F401
