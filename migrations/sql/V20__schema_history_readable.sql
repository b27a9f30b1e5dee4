-- Each release's services and relays can wait for the schema it needs (`migrate --wait`, the
-- first init container of each pod in deploy/k8s) with their own credentials, not the
-- superuser's: they may read which migrations ran, nothing more.
GRANT SELECT ON refinery_schema_history TO consumers, workers, consumers_relay, workers_relay;
