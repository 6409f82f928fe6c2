# The MLflow tracking server of docker-compose.yml: MLflow with its `db` extra, the Postgres drivers (psycopg 3
# and psycopg2) that the official ghcr.io/mlflow/mlflow image does not carry. docker-compose.yml sets the command.
FROM python:3.12-slim
ARG MLFLOW_VERSION=3.17.2
RUN pip install --no-cache-dir "mlflow[db]==${MLFLOW_VERSION}"
EXPOSE 5000
CMD ["mlflow", "server", "--host", "0.0.0.0", "--port", "5000"]
