-- Each release's services and relays can wait for the schema it needs (`migrate --wait`, the
-- first init container of each pod in deploy/k8s) with their own credentials, not the
-- superuser's: they may read which migrations ran, nothing more. The history table is in the
-- schema `migrate` created it in (its role's first on the search path): that schema is looked
-- up, its USAGE granted too (a hardened `public` has none for PUBLIC), and a grant that did
-- not take (the migrating role not owning the table) fails the migration.
DO $$
DECLARE
  schema text;
  reader text;
BEGIN
  SELECT n.nspname INTO STRICT schema
    FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
   WHERE c.relname = 'refinery_schema_history' AND c.relkind = 'r'
   ORDER BY n.nspname = 'public' DESC LIMIT 1;
  FOREACH reader IN ARRAY ARRAY['consumers', 'workers', 'consumers_relay', 'workers_relay'] LOOP
    EXECUTE format('GRANT USAGE ON SCHEMA %I TO %I', schema, reader);
    EXECUTE format('GRANT SELECT ON %I.refinery_schema_history TO %I', schema, reader);
    IF NOT has_table_privilege(reader, format('%I.refinery_schema_history', schema), 'SELECT') THEN
      RAISE EXCEPTION 'could not let % read %.refinery_schema_history: run migrate as its owner', reader, schema;
    END IF;
  END LOOP;
END
$$;
