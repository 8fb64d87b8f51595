"""Reports of a suite, from its results database alone.

* ``data``    - what a report shows, gathered from the database (``collect`` -> ``ReportData``)
* ``tables``  - the tables, as (header, rows) of strings
* ``text``    - the prose: the overview facts and the notes under the tables
* ``figures`` - the plots
* ``render``  - report.md, report.html and the console table
* ``trend``   - how a verdict moves between suites (model sizes) or training lengths

Everything a caller needs is re-exported here: ``from archlab.lab.report import write_report``.
"""

from archlab.lab.report.render import *  # noqa: F401,F403
from archlab.lab.report.render import __all__  # noqa: F401
