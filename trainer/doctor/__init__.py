"""`parityrl doctor`: where a mismatch between the engine and the trainer comes from, as a battery of checks on the
same token ids, each with a figure, the level expected for the recipe's dtype and precision, and a verdict
(docs/doctor.md). The checks (one file each under ``checks/``) share one started engine and one trainer model
(``context.Doctor``); ``battery`` runs them, ``trainer.diagnostics.doctor_report`` prints the table and writes
``doctor.json``.
"""
