"""The worker on Faust: its app and wiring (``app``), the batch path out of Faust's consumer
(``faust_batches``), the fold of each record into the view (``keeper``), the table's
files and changelog (``table_mirror``), following other workers' partitions
(``follower``), and readiness, stall watch and shutdown."""
