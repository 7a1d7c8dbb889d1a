# One image for every rlbus service: controller, worker and the demo trainer.
FROM python:3.11-slim
WORKDIR /app
RUN pip install --no-cache-dir torch==2.13.0
COPY . /app
RUN pip install --no-cache-dir /app
ENTRYPOINT ["rlbus"]
