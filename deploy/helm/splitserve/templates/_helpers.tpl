{{/* The RayCluster's name; every other object's name starts with it. */}}
{{- define "splitserve.fullname" -}}
{{- default .Release.Name .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{- define "splitserve.labels" -}}
app.kubernetes.io/name: splitserve
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "splitserve.image" -}}
{{ printf "%s:%s" .Values.image.repository .Values.image.tag }}
{{- end -}}

{{/* Labels KubeRay puts on the pods of one group of the RayCluster: Service selectors. */}}
{{- define "splitserve.headSelector" -}}
ray.io/cluster: {{ include "splitserve.fullname" . }}
ray.io/node-type: head
{{- end -}}

{{/* The router group's pods: the router Service's selector. */}}
{{- define "splitserve.routerSelector" -}}
ray.io/cluster: {{ include "splitserve.fullname" . }}
ray.io/group: router
{{- end -}}

{{/* The Redis Ray's GCS keeps its state in: the release's own, or gcsFaultTolerance.externalAddress. */}}
{{- define "splitserve.gcsRedisAddress" -}}
{{- if .Values.gcsFaultTolerance.redis.enabled -}}
{{ include "splitserve.fullname" . }}-gcs-redis:6379
{{- else -}}
{{ .Values.gcsFaultTolerance.externalAddress }}
{{- end -}}
{{- end -}}

{{/* Worker and router pods wait this long for a restarting head's GCS before they exit. */}}
{{- define "splitserve.gcsReconnectEnv" -}}
{{- if .Values.gcsFaultTolerance.enabled -}}
- name: RAY_gcs_rpc_server_reconnect_timeout_s
  value: {{ .Values.gcsFaultTolerance.reconnectTimeoutS | quote }}
{{- end -}}
{{- end -}}

{{- define "splitserve.redisUrl" -}}
{{- if .Values.redis.enabled -}}
redis://{{ include "splitserve.fullname" . }}-redis:6379/0
{{- else -}}
{{ .Values.redis.externalUrl }}
{{- end -}}
{{- end -}}

{{/*
Checks the schema cannot express (it cannot compare two fields); each fails the install with a
sentence naming the values involved.
*/}}
{{/*
GPUs one pod of a pool holds: its replica's tp x pp ranks (or ep, for an expert-parallel decode
replica). Called with dict root, pool.
*/}}
{{- define "splitserve.podGpus" -}}
{{- $p := index .root.Values .pool -}}
{{- max (mul (int $p.tp) (int (default 1 $p.pp))) (int (default 1 $p.ep)) -}}
{{- end -}}

{{- define "splitserve.validate" -}}
{{- range $pool := list "prefill" "decode" }}
{{- $p := index $.Values $pool }}
{{- $gpus := include "splitserve.podGpus" (dict "root" $ "pool" $pool) | int }}
{{- $perNode := int $.Values.gpusPerNode }}
{{- if and (gt $perNode 0) (gt (int (default 1 $p.pp)) 1) (ne (mod $perNode $gpus) 0) }}
{{- fail (printf "%s.tp x %s.pp is %d GPUs a pod (every stage of a replica on its pod), which gpusPerNode (%d) is not a multiple of" $pool $pool $gpus $perNode) }}
{{- end }}
{{- if or (lt (int $p.replicas) (int $p.minReplicas)) (gt (int $p.replicas) (int $p.maxReplicas)) }}
{{- fail (printf "%s.replicas (%d) must lie within %s.minReplicas (%d) and %s.maxReplicas (%d)" $pool (int $p.replicas) $pool (int $p.minReplicas) $pool (int $p.maxReplicas)) }}
{{- end }}
{{- end }}
{{- $ft := .Values.gcsFaultTolerance }}
{{- if $ft.enabled }}
{{- if and $ft.redis.enabled $ft.externalAddress }}
{{- fail "gcsFaultTolerance.redis.enabled starts a Redis for the GCS and gcsFaultTolerance.externalAddress names another: set one of them" }}
{{- end }}
{{- if not (or $ft.redis.enabled $ft.externalAddress) }}
{{- fail "gcsFaultTolerance.enabled needs a Redis: set gcsFaultTolerance.redis.enabled true or gcsFaultTolerance.externalAddress" }}
{{- end }}
{{- if and $ft.tls.caSecretName (not (hasPrefix "rediss://" $ft.externalAddress)) }}
{{- fail "gcsFaultTolerance.tls.caSecretName is for a TLS Redis: gcsFaultTolerance.externalAddress must start with rediss://" }}
{{- end }}
{{- end }}
{{- if and .Values.redis.enabled .Values.redis.externalUrl }}
{{- fail "redis.enabled starts a Redis StatefulSet and redis.externalUrl names another server: set one of them" }}
{{- end }}
{{- if and (or (gt (int (default 1 .Values.prefill.pp)) 1) (gt (int (default 1 .Values.decode.pp)) 1)) (or (gt (int64 .Values.engine.cpuKvCacheBytes) 0) (include "splitserve.redisUrl" .)) }}
{{- fail "prefill.pp or decode.pp above 1 with a CPU or Redis KV tier: the engine serves the tiers on replicas of one pipeline stage so far; set pp to 1, or engine.cpuKvCacheBytes to 0 and turn Redis off" }}
{{- end }}
{{- end -}}

{{/* The volumes every Ray pod mounts: shared memory, the conversion cache, the model claim. */}}
{{- define "splitserve.volumes" -}}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .shmSize }}
- name: cache
  emptyDir: {}
{{- if .root.Values.model.pvc.claimName }}
- name: model
  persistentVolumeClaim:
    claimName: {{ .root.Values.model.pvc.claimName }}
    readOnly: true
{{- end }}
{{- if .root.Values.clusterTLS.enabled }}
- name: cluster-ca
  secret:
    secretName: {{ .root.Values.clusterTLS.caSecretName }}
    defaultMode: 0400
- name: cluster-tls
  emptyDir:
    medium: Memory
{{- end }}
{{- end -}}

{{- define "splitserve.volumeMounts" -}}
- name: dshm
  mountPath: /dev/shm
- name: cache
  mountPath: /var/cache/splitserve
{{- if .Values.model.pvc.claimName }}
- name: model
  mountPath: {{ .Values.model.pvc.mountPath }}
  readOnly: true
{{- end }}
{{- if .Values.clusterTLS.enabled }}
- name: cluster-tls
  mountPath: /etc/splitserve/cluster-tls
  readOnly: true
{{- end }}
{{- end -}}

{{/*
Cluster TLS (Ray's own gRPC and the request plane): an init container issues the pod's own
certificate from the cluster CA, for its pod IP and the DNS names given (dict root, dns), into a
memory volume the Ray container reads; the CA's key is mounted in the init container only.
*/}}
{{- define "splitserve.clusterTLS.initContainers" -}}
{{- if .root.Values.clusterTLS.enabled -}}
initContainers:
  - name: node-cert
    image: {{ include "splitserve.image" .root }}
    imagePullPolicy: {{ .root.Values.image.pullPolicy }}
    command: ["splitserve"]
    args:
      - node-cert
      - --ca-cert
      - /etc/splitserve/cluster-ca/ca.crt
      - --ca-key
      - /etc/splitserve/cluster-ca/ca.key
      - --out
      - /etc/splitserve/cluster-tls
      - --ip
      - $(POD_IP)
      {{- range .dns }}
      - --dns
      - {{ . }}
      {{- end }}
    env:
      - name: POD_IP
        valueFrom:
          fieldRef:
            fieldPath: status.podIP
    volumeMounts:
      - name: cluster-ca
        mountPath: /etc/splitserve/cluster-ca
        readOnly: true
      - name: cluster-tls
        mountPath: /etc/splitserve/cluster-tls
{{- end }}
{{- end -}}

{{/* The Ray container's options for the certificate its init container issued. */}}
{{- define "splitserve.clusterTLS.args" -}}
{{- if .Values.clusterTLS.enabled -}}
- --cluster-tls-cert
- /etc/splitserve/cluster-tls/tls.crt
- --cluster-tls-key
- /etc/splitserve/cluster-tls/tls.key
- --cluster-tls-ca
- /etc/splitserve/cluster-tls/ca.crt
{{- end }}
{{- end -}}

{{- define "splitserve.env" -}}
- name: SPLITSERVE_CACHE_DIR
  value: /var/cache/splitserve
- name: RAY_USAGE_STATS_ENABLED
  value: "0"
{{- end -}}

{{/* The metrics Services' scrape annotations, when no ServiceMonitor does that job. */}}
{{- define "splitserve.scrapeAnnotations" -}}
{{- if not .root.Values.metrics.serviceMonitor.enabled -}}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .port | quote }}
prometheus.io/path: /metrics
{{- end -}}
{{- end -}}
