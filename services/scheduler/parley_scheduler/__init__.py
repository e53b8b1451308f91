"""The scheduler service: durable tasks in Postgres, claimed once per slot across replicas, run by workers."""
