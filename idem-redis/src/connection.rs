//! One connection type over a single node and a cluster, and how a URL picks it.

use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
use redis::{Cmd, Pipeline, RedisFuture, RedisResult, Value};

use crate::SetupError;

/// The URL scheme of a Redis Cluster: `redis+cluster://HOST:PORT[,HOST:PORT…]`.
pub(crate) const CLUSTER_SCHEME: &str = "redis+cluster://";
/// The same over TLS.
const CLUSTER_TLS_SCHEME: &str = "rediss+cluster://";

/// The store's connection to Redis, for an application's own commands and
/// scripts next to the store's (the payments example keeps its ledger with it):
/// a multiplexed connection that reconnects by itself, to one node or to a
/// cluster (following `MOVED` and `ASK`, refreshing its slot map). It is a
/// redis-rs [`ConnectionLike`]; cloning it is cheap and shares the connection.
///
/// From [`RedisStore::connection`](crate::RedisStore::connection).
#[derive(Clone)]
pub enum RedisConnection {
    /// One node, through redis-rs's `ConnectionManager`.
    Single(ConnectionManager),
    /// A Redis Cluster, through redis-rs's async cluster connection.
    Cluster(ClusterConnection),
}

/// How the connection fails and recovers.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Timeouts {
    pub(crate) connect: Duration,
    pub(crate) response: Duration,
}

impl RedisConnection {
    /// Connects to what `url` names. A single node is connected lazily (the
    /// first step connects; an application may start while Redis is down); a
    /// cluster is asked for its slot map now.
    pub(crate) async fn open(url: &str, timeouts: Timeouts) -> Result<Self, SetupError> {
        if let Some(nodes) = url
            .strip_prefix(CLUSTER_SCHEME)
            .map(|rest| ("redis://", rest))
            .or_else(|| {
                url.strip_prefix(CLUSTER_TLS_SCHEME)
                    .map(|rest| ("rediss://", rest))
            })
        {
            let (scheme, rest) = nodes;
            let nodes = cluster_nodes(scheme, rest)?;
            let client = ClusterClientBuilder::new(nodes)
                .connection_timeout(timeouts.connect)
                .response_timeout(timeouts.response)
                // Few, short retries: a step against a cluster that is down
                // fails within about a second, so the request is answered 503.
                .retries(2)
                .min_retry_wait(10)
                .max_retry_wait(200)
                .build()
                .map_err(SetupError::Url)?;
            let connection = client
                .get_async_connection()
                .await
                .map_err(SetupError::Connect)?;
            return Ok(Self::Cluster(connection));
        }
        let client = redis::Client::open(url).map_err(SetupError::Url)?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(timeouts.connect))
            .set_response_timeout(Some(timeouts.response))
            .set_number_of_retries(1)
            .set_min_delay(Duration::from_millis(10))
            .set_max_delay(Duration::from_millis(200));
        let manager =
            ConnectionManager::new_lazy_with_config(client, config).map_err(SetupError::Url)?;
        Ok(Self::Single(manager))
    }

    /// The addresses of the primaries holding keys: the node itself, or every
    /// cluster primary (from `CLUSTER SLOTS`). `None` stands for "this
    /// connection's one node".
    pub(crate) async fn primaries(&mut self) -> RedisResult<Vec<Option<(String, u16)>>> {
        let Self::Cluster(cluster) = self else {
            return Ok(vec![None]);
        };
        let slots = cluster
            .route_command(
                redis::cmd("CLUSTER").arg("SLOTS").clone(),
                RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random),
            )
            .await?;
        let mut primaries = Vec::new();
        // Each range: [start, end, [host, port, id, …], replicas…].
        for range in redis::from_redis_value::<Vec<Vec<Value>>>(slots)? {
            let Some(Value::Array(primary)) = range.get(2) else {
                continue;
            };
            let (Some(host), Some(port)) = (primary.first(), primary.get(1)) else {
                continue;
            };
            let address = Some((
                redis::from_redis_value_ref::<String>(host)?,
                redis::from_redis_value_ref::<u16>(port)?,
            ));
            if !primaries.contains(&address) {
                primaries.push(address);
            }
        }
        Ok(primaries)
    }

    /// Runs `cmd` on one node: `None` for the single node.
    pub(crate) async fn on_node(
        &mut self,
        node: &Option<(String, u16)>,
        cmd: Cmd,
    ) -> RedisResult<Value> {
        match (self, node) {
            (Self::Cluster(cluster), Some((host, port))) => {
                cluster
                    .route_command(
                        cmd,
                        RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                            host: host.clone(),
                            port: *port,
                        }),
                    )
                    .await
            }
            (connection, _) => cmd.query_async(connection).await,
        }
    }
}

/// One node's commands are tried a second time when the first found no
/// connection (`ECONNREFUSED`: nothing was sent). `ConnectionManager` keeps the
/// outcome of its last reconnection: after an outage, that is the refusal of an
/// attempt made while the server was down, and the first command after the
/// server is back would fail on it, only starting a new attempt. The second try
/// waits for that attempt, so the first request after an outage succeeds. A
/// command that may have reached the server (a connection dropped mid-way) is
/// not repeated. The cluster client retries by itself.
impl ConnectionLike for RedisConnection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Self::Single(connection) => Box::pin(async move {
                match connection.req_packed_command(cmd).await {
                    Err(error) if error.is_connection_refusal() => {
                        connection.req_packed_command(cmd).await
                    }
                    answered => answered,
                }
            }),
            Self::Cluster(connection) => connection.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Self::Single(connection) => Box::pin(async move {
                match connection
                    .req_packed_commands(pipeline, offset, count)
                    .await
                {
                    Err(error) if error.is_connection_refusal() => {
                        connection
                            .req_packed_commands(pipeline, offset, count)
                            .await
                    }
                    answered => answered,
                }
            }),
            Self::Cluster(connection) => connection.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Single(connection) => connection.get_db(),
            Self::Cluster(connection) => connection.get_db(),
        }
    }
}

/// `[user:password@]host:port,host:port…[/…]` → one URL per node, each with the
/// credentials.
fn cluster_nodes(scheme: &str, rest: &str) -> Result<Vec<String>, SetupError> {
    let rest = rest.split(['/', '?']).next().unwrap_or_default();
    let (credentials, hosts) = match rest.rsplit_once('@') {
        Some((credentials, hosts)) => (format!("{credentials}@"), hosts),
        None => (String::new(), rest),
    };
    let nodes: Vec<String> = hosts
        .split(',')
        .map(str::trim)
        .filter(|host| !host.is_empty())
        .map(|host| format!("{scheme}{credentials}{host}"))
        .collect();
    if nodes.is_empty() {
        return Err(SetupError::NoClusterNodes);
    }
    Ok(nodes)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn cluster_urls_name_every_node_with_the_credentials() {
        assert_eq!(
            cluster_nodes("redis://", "u:p@a:1,b:2/0").unwrap(),
            ["redis://u:p@a:1", "redis://u:p@b:2"]
        );
        assert_eq!(cluster_nodes("rediss://", "a:1").unwrap(), ["rediss://a:1"]);
        assert!(matches!(
            cluster_nodes("redis://", ""),
            Err(SetupError::NoClusterNodes)
        ));
    }
}
