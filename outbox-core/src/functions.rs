//! Redis Functions: every server-side script of the relay, the consumers and the services is
//! a function of a library loaded once (`FUNCTION LOAD`), so their Redis users need `FCALL`
//! and nothing else: without `EVAL`, `EVALSHA`, `SCRIPT LOAD` and `FUNCTION LOAD`, no
//! component can run code of its own choosing (one endless loop would stall Redis for both
//! sides).
//!
//! Invariants:
//! - a library's name carries a digest of its code, and each function's name its library's:
//!   a caller runs exactly the bodies it was built with, and two versions live side by side
//!   during a rolling deploy (an old library is never replaced under its callers);
//! - a body is the script it replaced, unchanged: `KEYS` and `ARGV` are the callback's
//!   parameters;
//! - a missing library (a new Redis, or one that lost its data) is loaded by the caller when
//!   its user may (`FUNCTION LOAD`: tests, development); otherwise the call fails with a
//!   transient error (code [`NOT_LOADED`]) that names the admin step, and succeeds once it
//!   ran.

use redis::aio::ConnectionLike;
use redis::{
    Cmd, ErrorKind, FromRedisValue, RedisError, RedisResult, ServerErrorKind, ToRedisArgs,
};

/// The error code of a call whose library is not loaded and could not be.
pub const NOT_LOADED: &str = "NOTLOADED";

/// One function of a library: its name (within the library), its body (a script's text,
/// reading `KEYS` and `ARGV`), and its flags (`allow-oom` for one that only frees memory).
pub struct Body {
    pub name: &'static str,
    pub body: &'static str,
    pub flags: &'static [&'static str],
}

/// A function library: its versioned name and the code `FUNCTION LOAD` takes.
pub struct Library {
    name: String,
    code: String,
    functions: Vec<&'static str>,
    /// When this process's user was last refused loading it: not asked again for a while,
    /// so a missing library does not fill Redis's ACL log with one refusal per call.
    refused_at: std::sync::Mutex<Option<std::time::Instant>>,
}

/// How long a refused load is not tried again.
const REFUSED_FOR: std::time::Duration = std::time::Duration::from_secs(30);

impl Library {
    /// The library `<prefix>_<digest>` of `functions`; `prefix` names the component.
    pub fn new(prefix: &str, functions: &[Body]) -> Library {
        const PLACEHOLDER: &str = "@library@";
        let mut code = String::new();
        for f in functions {
            let flags: Vec<String> = f.flags.iter().map(|flag| format!("'{flag}'")).collect();
            let flags = if flags.is_empty() {
                String::new()
            } else {
                format!("flags={{{}}}, ", flags.join(", "))
            };
            code.push_str(&format!(
                "redis.register_function{{function_name='{PLACEHOLDER}_{}', {flags}callback=function(KEYS, ARGV)\n{}\nend}}\n",
                f.name,
                f.body.trim_end(),
            ));
        }
        // Not a security measure: a version stamp (SHA-1, as Redis names scripts).
        let digest = redis::Script::new(&code).get_hash()[..12].to_string();
        let name = format!("{prefix}_{digest}");
        let code = format!("#!lua name={name}\n{}", code.replace(PLACEHOLDER, &name));
        Library {
            name,
            code,
            functions: functions.iter().map(|f| f.name).collect(),
            refused_at: std::sync::Mutex::new(None),
        }
    }

    /// The library's versioned name (`FUNCTION LIST LIBRARYNAME`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The code `FUNCTION LOAD` takes.
    pub fn code(&self) -> &str {
        &self.code
    }

    /// The function `name` of this library. Panics for a name the library does not define
    /// (a programming error, caught by any test that calls it).
    pub fn function(&'static self, name: &str) -> Function {
        assert!(
            self.functions.contains(&name),
            "library {} defines no function {name}",
            self.name
        );
        Function {
            library: self,
            name: format!("{}_{name}", self.name),
        }
    }

    /// Load the library (on every primary of a cluster). Loading it again is harmless: the
    /// name says which code it holds. A user that may not load it gets [`NOT_LOADED`]
    /// (transient: it succeeds once the admin step ran); code Redis cannot compile or
    /// register is a permanent error (a programming one).
    pub async fn load<C: ConnectionLike + Send>(&self, conn: &mut C) -> RedisResult<()> {
        let loaded: RedisResult<String> = redis::cmd("FUNCTION")
            .arg("LOAD")
            .arg("REPLACE")
            .arg(&self.code)
            .query_async(conn)
            .await;
        match loaded {
            Ok(_) => Ok(()),
            Err(e) if is_no_permission(&e) => {
                *self.refused_at.lock().expect("not poisoned") = Some(std::time::Instant::now());
                Err(self.not_loaded())
            }
            // Code Redis cannot take (a programming error) is permanent; any other answer
            // (a proxy's, a busy server's) is what it is.
            Err(e)
                if e.kind() == ErrorKind::Server(ServerErrorKind::ResponseError)
                    && ["Error compiling", "Error registering", "unknown command"]
                        .iter()
                        .any(|what| e.to_string().contains(what)) =>
            {
                Err(RedisError::from((
                    ErrorKind::InvalidClientConfig,
                    "Redis refused a function library",
                    format!("{}: {e}", self.name),
                )))
            }
            Err(e) => Err(e),
        }
    }

    /// [`Library::load`] for a call that found its function missing: not tried again for a
    /// while after this process was refused (each refusal is a line in Redis's ACL log).
    async fn load_when_missing<C: ConnectionLike + Send>(&self, conn: &mut C) -> RedisResult<()> {
        let refused_lately = self
            .refused_at
            .lock()
            .expect("not poisoned")
            .is_some_and(|at| at.elapsed() < REFUSED_FOR);
        if refused_lately {
            return Err(self.not_loaded());
        }
        self.load(conn).await
    }

    fn not_loaded(&self) -> RedisError {
        redis::make_extension_error(
            NOT_LOADED.into(),
            Some(format!(
                "Redis function library {} is not loaded (a new Redis, or one that lost its data) and this user may not load it: load it as Redis's admin with `migrate --redis-url` (the services' libraries) and `cdc-relay functions` (the relays'); see docs/deployment.md, \"Redis functions\"",
                self.name
            )),
        )
    }
}

/// Load `libraries` as an admin (the admin step), retrying what may pass later (Redis not
/// up yet, loading its data) for up to `patience`; the names loaded.
pub async fn load_all(
    target: &crate::connect::RedisTarget,
    libraries: &[&Library],
    patience: std::time::Duration,
) -> RedisResult<Vec<String>> {
    let timeout = std::time::Duration::from_secs(10);
    let deadline = tokio::time::Instant::now() + patience;
    loop {
        let attempt = async {
            let mut conn = target.connect(timeout).await?;
            let mut names = Vec::new();
            for library in libraries {
                library.load(&mut conn).await?;
                names.push(library.name().to_string());
            }
            Ok::<_, RedisError>(names)
        };
        match attempt.await {
            Ok(names) => return Ok(names),
            Err(e)
                if crate::error::redis_is_transient(&e)
                    && e.code() != Some(NOT_LOADED)
                    && tokio::time::Instant::now() < deadline =>
            {
                tracing::info!(error = %e, "redis not ready for the functions yet; trying again");
                tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            }
            Err(e) => return Err(e),
        }
    }
}

fn is_no_permission(e: &RedisError) -> bool {
    e.kind() == ErrorKind::Server(ServerErrorKind::NoPerm) || e.code() == Some("NOPERM")
}

/// Whether Redis refused a call because it holds no such function.
pub fn is_missing(e: &RedisError) -> bool {
    e.kind() == ErrorKind::Server(ServerErrorKind::ResponseError)
        && e.to_string().contains("Function not found")
}

/// A function to call (`FCALL`), like `redis::Script` is a script to evaluate.
pub struct Function {
    library: &'static Library,
    name: String,
}

impl Function {
    /// The function's full name (`FCALL` takes it).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// A call with its first key.
    pub fn key<T: ToRedisArgs>(&self, key: T) -> Call<'_> {
        let mut call = self.call();
        call.key(key);
        call
    }

    /// A call with its first argument (and no key).
    pub fn arg<T: ToRedisArgs>(&self, arg: T) -> Call<'_> {
        let mut call = self.call();
        call.arg(arg);
        call
    }

    /// A call without keys or arguments yet.
    pub fn call(&self) -> Call<'_> {
        Call {
            function: self,
            keys: Vec::new(),
            args: Vec::new(),
        }
    }
}

/// One call of a [`Function`]: its keys and arguments.
pub struct Call<'a> {
    function: &'a Function,
    keys: Vec<Vec<u8>>,
    args: Vec<Vec<u8>>,
}

impl Call<'_> {
    pub fn key<T: ToRedisArgs>(&mut self, key: T) -> &mut Self {
        self.keys.extend(key.to_redis_args());
        self
    }

    pub fn arg<T: ToRedisArgs>(&mut self, arg: T) -> &mut Self {
        self.args.extend(arg.to_redis_args());
        self
    }

    /// The `FCALL` command, to send in a pipeline; a reply [`is_missing`] asks for
    /// [`Call::load_library`] and the call again.
    pub fn cmd(&self) -> Cmd {
        let mut cmd = redis::cmd("FCALL");
        cmd.arg(&self.function.name)
            .arg(self.keys.len())
            .arg(&self.keys)
            .arg(&self.args);
        cmd
    }

    /// Load the function's library after a call found it missing (see [`Library::load`];
    /// after a refusal, not asked again for a while).
    pub async fn load_library<C: ConnectionLike + Send>(&self, conn: &mut C) -> RedisResult<()> {
        self.function.library.load_when_missing(conn).await
    }

    /// Call the function; when Redis does not hold it, load its library and call once more.
    pub async fn invoke_async<T: FromRedisValue>(
        &self,
        conn: &mut (impl ConnectionLike + Send),
    ) -> RedisResult<T> {
        match self.cmd().query_async(conn).await {
            Err(e) if is_missing(&e) => {
                self.load_library(conn).await?;
                self.cmd().query_async(conn).await
            }
            other => other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    static LIB: std::sync::LazyLock<Library> = std::sync::LazyLock::new(|| {
        Library::new(
            "test",
            &[
                Body {
                    name: "get",
                    body: "return redis.call('GET', KEYS[1])",
                    flags: &["no-writes"],
                },
                Body {
                    name: "drop",
                    body: "return redis.call('DEL', KEYS[1])",
                    flags: &["allow-oom"],
                },
            ],
        )
    });

    #[test]
    fn a_library_is_named_by_its_code() {
        let other = Library::new(
            "test",
            &[Body {
                name: "get",
                body: "return redis.call('GET', KEYS[2])",
                flags: &[],
            }],
        );
        assert!(LIB.name().starts_with("test_"));
        assert_ne!(LIB.name(), other.name(), "another body, another name");
        assert!(LIB
            .code()
            .starts_with(&format!("#!lua name={}\n", LIB.name())));
        let function = LIB.function("get");
        assert_eq!(function.name(), format!("{}_get", LIB.name()));
        assert!(LIB.code().contains(&format!(
            "function_name='{}', flags={{'no-writes'}}, callback=function(KEYS, ARGV)\nreturn redis.call('GET', KEYS[1])\nend}}",
            function.name()
        )));
        let packed = LIB
            .function("drop")
            .key("k")
            .arg(7)
            .cmd()
            .get_packed_command();
        let text = String::from_utf8(packed).unwrap();
        assert!(text.contains("FCALL") && text.contains("_drop"), "{text}");
    }

    #[test]
    #[should_panic(expected = "defines no function")]
    fn an_unknown_function_is_a_programming_error() {
        LIB.function("set");
    }
}
