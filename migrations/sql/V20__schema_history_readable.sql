-- Each release's services and relays can wait for the schema it needs (`migrate --wait`, the
-- first init container of each pod in deploy/k8s) with their own credentials, not the
-- superuser's: they may read which migrations ran, nothing more. The history table is the one
-- `migrate` uses (found through its own search path, as refinery found it); USAGE on its
-- schema is granted too (a hardened `public` has none for PUBLIC), and a grant that did not
-- take (the migrating role owning neither) fails the migration.
DO $$
DECLARE
  history regclass := to_regclass('refinery_schema_history');
  schema text;
  reader text;
BEGIN
  IF history IS NULL THEN
    RAISE EXCEPTION 'refinery_schema_history is not on the search path of the role running migrate';
  END IF;
  SELECT n.nspname INTO STRICT schema
    FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
   WHERE c.oid = history;
  FOREACH reader IN ARRAY ARRAY['consumers', 'workers', 'consumers_relay', 'workers_relay'] LOOP
    EXECUTE format('GRANT USAGE ON SCHEMA %I TO %I', schema, reader);
    EXECUTE format('GRANT SELECT ON %s TO %I', history, reader);
    IF NOT (has_schema_privilege(reader, schema, 'USAGE')
            AND has_table_privilege(reader, history, 'SELECT')) THEN
      RAISE EXCEPTION 'could not let % read %: run migrate as the owner of it and of its schema', reader, history;
    END IF;
  END LOOP;
END
$$;
