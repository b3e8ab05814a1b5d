//! S3 (`s3://bucket/prefix`), through `object_store`'s AWS backend (feature `s3`).
//!
//! Credentials, endpoint and region come from the usual environment variables
//! (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`,
//! `AWS_ENDPOINT`, `AWS_REGION` or `AWS_DEFAULT_REGION`, `AWS_ALLOW_HTTP` for a
//! plain-HTTP endpoint such as a local Garage). Requests use path-style addressing
//! unless `AWS_VIRTUAL_HOSTED_STYLE_REQUEST=true`.
//!
//! The store is `PrefixStore(LimitStore(AmazonS3))`: HTTP requests are retried with
//! exponential backoff by the client ([`S3Options::max_retries`]), at most
//! [`S3Options::max_concurrency`] requests are in flight, and everything lives
//! under the URL's prefix. Large objects are uploaded in parts by the engine
//! (`WriteOptions::multipart_threshold`).
//!
//! The commit protocol does not rely on the server refusing a second create-only
//! put (Garage 2.5 does not): every key is unique to its save attempt.

use std::sync::Arc;
use std::time::Duration;

use object_store::ObjectStore;

use crate::error::{Error, Result};

/// How an S3 store is built. [`S3Options::from_env`] fills it from the environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct S3Options {
    /// Bucket name.
    pub bucket: String,
    /// Key prefix inside the bucket (no leading or trailing `/`; may be empty).
    pub prefix: String,
    /// Requests in flight at once (bounded by a semaphore).
    pub max_concurrency: usize,
    /// Retries of a failed HTTP request, with exponential backoff.
    pub max_retries: usize,
    /// First backoff delay.
    pub init_backoff: Duration,
    /// Longest backoff delay.
    pub max_backoff: Duration,
    /// Give up retrying a request after this long.
    pub retry_timeout: Duration,
    /// Timeout of one HTTP request.
    pub request_timeout: Duration,
    /// Timeout of establishing a connection.
    pub connect_timeout: Duration,
}

impl S3Options {
    /// Options for `bucket`/`prefix` with the defaults.
    pub fn new(bucket: impl Into<String>, prefix: impl Into<String>) -> Self {
        S3Options {
            bucket: bucket.into(),
            prefix: prefix.into().trim_matches('/').to_owned(),
            max_concurrency: 32,
            max_retries: 6,
            init_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(10),
            retry_timeout: Duration::from_secs(120),
            request_timeout: Duration::from_secs(300),
            connect_timeout: Duration::from_secs(10),
        }
    }

    /// Parse `s3://bucket/prefix`.
    pub fn from_url(url: &str) -> Result<Self> {
        let parsed = url::Url::parse(url)
            .map_err(|e| Error::InvalidInput(format!("bad URL `{url}`: {e}")))?;
        if parsed.scheme() != "s3" {
            return Err(Error::InvalidInput(format!("`{url}` is not an s3:// URL")));
        }
        let bucket = parsed.host_str().unwrap_or_default();
        if bucket.is_empty() {
            return Err(Error::InvalidInput(format!(
                "`{url}` names no bucket (use s3://bucket/prefix)"
            )));
        }
        if parsed.query().is_some() || parsed.fragment().is_some() {
            return Err(Error::InvalidInput(format!(
                "`{url}`: S3 URLs take no query or fragment"
            )));
        }
        Ok(S3Options::new(bucket, parsed.path()))
    }

    /// Check that the environment names credentials, so that a missing variable is
    /// reported before the first request rather than as an opaque HTTP failure.
    pub fn check_env() -> Result<()> {
        let set = |k: &str| std::env::var(k).map(|v| !v.is_empty()).unwrap_or(false);
        match (set("AWS_ACCESS_KEY_ID"), set("AWS_SECRET_ACCESS_KEY")) {
            (true, true) => Ok(()),
            (true, false) | (false, true) => Err(Error::InvalidInput(
                "incomplete S3 credentials: set both AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY".into(),
            )),
            (false, false)
                if set("AWS_WEB_IDENTITY_TOKEN_FILE")
                    || set("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI")
                    || set("AWS_CONTAINER_CREDENTIALS_FULL_URI")
                    || set("CKPT_S3_INSTANCE_CREDENTIALS") =>
            {
                Ok(())
            }
            (false, false) => Err(Error::InvalidInput(
                "no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_ENDPOINT, AWS_REGION \
                 for a non-AWS server), or CKPT_S3_INSTANCE_CREDENTIALS=1 to use the instance's role"
                    .into(),
            )),
        }
    }
}

/// Environment variable: `1` (or `true`, `on`) declares that the S3 server
/// honours conditional puts (`If-None-Match: *`), as AWS S3 has since 2024.
/// Writer epochs are then claimed atomically there; otherwise (the default,
/// right for Garage, which ignores them) a claim is read back: best effort.
pub const CONDITIONAL_PUT_ENV: &str = "CKPT_S3_CONDITIONAL_PUT";

/// Whether [`CONDITIONAL_PUT_ENV`] declares conditional puts.
pub fn conditional_put_from_env() -> bool {
    std::env::var(CONDITIONAL_PUT_ENV)
        .is_ok_and(|v| matches!(v.trim(), "1" | "true" | "on" | "yes"))
}

/// Open `s3://bucket/prefix` with default options and credentials from the environment.
pub fn open_url(url: &str) -> Result<Arc<dyn ObjectStore>> {
    open(&S3Options::from_url(url)?)
}

/// Open an S3 store with these options and credentials from the environment.
#[cfg(feature = "s3")]
pub fn open(opts: &S3Options) -> Result<Arc<dyn ObjectStore>> {
    use object_store::aws::AmazonS3Builder;
    use object_store::limit::LimitStore;
    use object_store::prefix::PrefixStore;
    use object_store::{BackoffConfig, ClientOptions, RetryConfig};

    S3Options::check_env()?;
    install_tls_provider();
    if opts.max_concurrency == 0 {
        return Err(Error::InvalidInput(
            "S3 max_concurrency must be at least 1".into(),
        ));
    }
    let retry = RetryConfig {
        backoff: BackoffConfig {
            init_backoff: opts.init_backoff,
            max_backoff: opts.max_backoff,
            base: 2.0,
        },
        max_retries: opts.max_retries,
        retry_timeout: opts.retry_timeout,
    };
    let mut client = ClientOptions::new()
        .with_timeout(opts.request_timeout)
        .with_connect_timeout(opts.connect_timeout);
    if std::env::var("AWS_ALLOW_HTTP").is_ok_and(|v| v.eq_ignore_ascii_case("true") || v == "1") {
        client = client.with_allow_http(true);
    }
    let mut builder = AmazonS3Builder::from_env()
        .with_bucket_name(&opts.bucket)
        .with_retry(retry)
        .with_client_options(client);
    let has_region = ["AWS_REGION", "AWS_DEFAULT_REGION"]
        .iter()
        .any(|k| std::env::var(k).is_ok());
    if !has_region {
        builder = builder.with_region("us-east-1");
    }
    let s3 = builder.build().map_err(|e| {
        Error::InvalidInput(format!(
            "S3 configuration for bucket `{}`: {e}",
            opts.bucket
        ))
    })?;
    let limited = LimitStore::new(s3, opts.max_concurrency);
    Ok(if opts.prefix.is_empty() {
        Arc::new(limited)
    } else {
        Arc::new(PrefixStore::new(limited, opts.prefix.as_str()))
    })
}

/// Make `ring` the process's TLS provider, which the HTTP client needs (it is
/// built without one of its own, see `core/Cargo.toml`). A provider that the
/// application installed first is kept.
#[cfg(feature = "s3")]
fn install_tls_provider() {
    if rustls::crypto::CryptoProvider::get_default().is_none() {
        // Losing a race to another installer leaves theirs, which serves as well.
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
}

/// Open an S3 store: this build has no S3 support.
#[cfg(not(feature = "s3"))]
pub fn open(opts: &S3Options) -> Result<Arc<dyn ObjectStore>> {
    Err(Error::Unsupported(format!(
        "s3://{}/{} needs ckpt-core built with the `s3` feature",
        opts.bucket, opts.prefix
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_urls() {
        let o = S3Options::from_url("s3://bkt/runs/7/").unwrap();
        assert_eq!((o.bucket.as_str(), o.prefix.as_str()), ("bkt", "runs/7"));
        assert_eq!(S3Options::from_url("s3://bkt").unwrap().prefix, "");
        assert!(matches!(
            S3Options::from_url("s3:///nobucket"),
            Err(Error::InvalidInput(_))
        ));
        assert!(matches!(
            S3Options::from_url("s3://b/p?x=1"),
            Err(Error::InvalidInput(_))
        ));
    }
}
