//! One shard: a tonic channel over a unix socket (one host) or TCP (a shard
//! group on another host, `pagemill shard --listen`), with the shared token
//! on every call when one is configured.

use std::path::PathBuf;

use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::interceptor::InterceptedService;
use tonic::service::Interceptor;
use tonic::transport::{Channel, Endpoint, Uri};

use crate::proto::pb;
use crate::proto::pb::text_generation_service_client::TextGenerationServiceClient;

type Rpc<T> = Result<T, tonic::Status>;

/// Where a shard listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ShardAddr {
    Unix(PathBuf),
    /// `host:port`.
    Tcp(String),
}

impl ShardAddr {
    /// `host:port` (or `tcp://host:port`) is TCP; anything else (`unix:PATH`,
    /// a path) a unix socket.
    pub fn parse(s: &str) -> Self {
        if let Some(rest) = s.strip_prefix("tcp://") {
            return ShardAddr::Tcp(rest.to_string());
        }
        if let Some(rest) = s.strip_prefix("unix:") {
            return ShardAddr::Unix(PathBuf::from(rest));
        }
        match s.rsplit_once(':') {
            Some((host, port)) if !host.is_empty() && !s.contains('/') && port.parse::<u16>().is_ok() => {
                ShardAddr::Tcp(s.to_string())
            }
            _ => ShardAddr::Unix(PathBuf::from(s)),
        }
    }
}

impl std::fmt::Display for ShardAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ShardAddr::Unix(p) => write!(f, "unix:{}", p.display()),
            ShardAddr::Tcp(a) => write!(f, "tcp://{a}"),
        }
    }
}

/// Adds `authorization: Bearer <token>` to every call when a token is set
/// (`--shard-auth-token-file`); the shard compares it in constant time.
#[derive(Debug, Clone, Default)]
pub struct ShardAuth(Option<MetadataValue<Ascii>>);

impl ShardAuth {
    pub fn token(token: &str) -> Result<Self, String> {
        let value = format!("Bearer {token}")
            .parse()
            .map_err(|_| "the shard auth token must be printable ASCII".to_string())?;
        Ok(Self(Some(value)))
    }
}

impl Interceptor for ShardAuth {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(v) = &self.0 {
            req.metadata_mut().insert("authorization", v.clone());
        }
        Ok(req)
    }
}

#[derive(Debug, Clone)]
pub struct ShardClient {
    inner: TextGenerationServiceClient<InterceptedService<Channel, ShardAuth>>,
}

impl ShardClient {
    pub async fn connect(addr: &ShardAddr, auth: ShardAuth) -> Result<Self, tonic::transport::Error> {
        let channel = match addr {
            ShardAddr::Tcp(a) => Endpoint::try_from(format!("http://{a}"))?.tcp_nodelay(true).connect().await?,
            ShardAddr::Unix(path) => {
                let socket = path.clone();
                // The URI is ignored by the connector; tonic only needs a valid one.
                Endpoint::try_from("http://[::]:50051")?
                    .connect_with_connector(tower::service_fn(move |_: Uri| {
                        let socket = socket.clone();
                        async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(socket).await?)) }
                    }))
                    .await?
            }
        };
        let inner = TextGenerationServiceClient::with_interceptor(channel, auth)
            .max_decoding_message_size(256 << 20)
            .max_encoding_message_size(256 << 20);
        Ok(Self { inner })
    }

    pub async fn info(&mut self) -> Rpc<pb::InfoResponse> {
        Ok(self.inner.info(pb::InfoRequest {}).await?.into_inner())
    }

    pub async fn health(&mut self) -> Rpc<pb::HealthResponse> {
        Ok(self.inner.health(pb::HealthRequest {}).await?.into_inner())
    }

    pub async fn warmup(&mut self, req: pb::WarmupRequest) -> Rpc<pb::WarmupResponse> {
        Ok(self.inner.warmup(req).await?.into_inner())
    }

    pub async fn step(&mut self, req: pb::StepRequest) -> Rpc<pb::StepResponse> {
        Ok(self.inner.step(req).await?.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_parse() {
        assert_eq!(ShardAddr::parse("10.0.0.2:7000"), ShardAddr::Tcp("10.0.0.2:7000".into()));
        assert_eq!(ShardAddr::parse("node-b:7000"), ShardAddr::Tcp("node-b:7000".into()));
        assert_eq!(ShardAddr::parse("tcp://[::1]:7000"), ShardAddr::Tcp("[::1]:7000".into()));
        assert_eq!(ShardAddr::parse("/tmp/p/shard-0.sock"), ShardAddr::Unix("/tmp/p/shard-0.sock".into()));
        assert_eq!(ShardAddr::parse("unix:/tmp/a:1"), ShardAddr::Unix("/tmp/a:1".into()));
        assert_eq!(ShardAddr::parse("shard.sock"), ShardAddr::Unix("shard.sock".into()));
    }

    #[test]
    fn the_token_goes_on_every_call() {
        let mut auth = ShardAuth::token("s3cret").unwrap();
        let req = auth.call(tonic::Request::new(())).unwrap();
        assert_eq!(req.metadata().get("authorization").unwrap(), "Bearer s3cret");
        let req = ShardAuth::default().call(tonic::Request::new(())).unwrap();
        assert!(req.metadata().get("authorization").is_none());
        assert!(ShardAuth::token("bad\ntoken").is_err());
    }
}
