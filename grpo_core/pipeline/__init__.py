"""The pipeline's decisions as plain functions: skip unchanged inputs, evaluate, compare with the champion,
register and report. The Prefect flow (flows/) is a recipe over them; tracking/ holds the sinks and clients.

start.py       the run every task reads (config, the champion as start model, a fresh run's directory)
inputs.py      the pipeline and inputs keys; a scheduled run's inputs against the last one's (skip unchanged)
run.py         the pipeline's MLflow run, found again by its key; its datasets and links
evaluations.py the evaluation file, settings and directories every model's evaluation shares
champion.py    the registry's champion, evaluated or (first run) the base registered; the promotion against it
promotion.py   champion or challenger: the decision, a pure function of the paired comparison
register.py    what a version is made of and tagged with; the base model as the first version
summary.py     the results as numbers: uplift, what moved, throughput, headline metrics
record.py      the results recorded in the MLflow run, step by step
report.py      the report text (results, a skipped run, a failure) and how far a flow run got
notices.py     when a notice is sent: a regression of a scheduled run, a failed flow run
"""
