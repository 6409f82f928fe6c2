-- Runs once, when the Postgres volume is first initialised (docker-entrypoint-initdb.d), as POSTGRES_USER.
-- One server, two databases: Prefect's (flow runs, deployments, logs) and MLflow's backend store (runs,
-- params, metrics, model registry). MLflow's artifacts live in the mlflow-artifacts volume, not here.
CREATE DATABASE prefect;
CREATE DATABASE mlflow;
-- Prefect's search indexes need pg_trgm (its migrations also create it; it ships with the postgres image).
\connect prefect
CREATE EXTENSION IF NOT EXISTS pg_trgm;
