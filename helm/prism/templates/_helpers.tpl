{{/* Names and labels. */}}
{{- define "prism.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "prism.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "prism.selectorLabels" -}}
app.kubernetes.io/name: {{ include "prism.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "prism.labels" -}}
{{ include "prism.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "prism.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* The API-key Secret's name, or "" when authentication is off (only with auth.allowAnonymous). */}}
{{- define "prism.authSecret" -}}
{{- if not .Values.auth.allowAnonymous -}}
{{- if .Values.auth.keys -}}
{{- printf "%s-api-keys" (include "prism.fullname" .) -}}
{{- else -}}
{{- .Values.auth.existingSecret -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Values that render but would deploy something unsafe or meaningless: refused with the reason. */}}
{{- define "prism.validate" -}}
{{- $auth := .Values.auth -}}
{{- if and (not $auth.allowAnonymous) (not $auth.keys) (not $auth.existingSecret) -}}
{{- fail "auth: no API keys. Set auth.existingSecret to the Secret holding them (API key -> tenant under auth.secretKey), or auth.keys to let the chart create it; to serve without authentication, set auth.allowAnonymous=true." -}}
{{- end -}}
{{- if and $auth.allowAnonymous $auth.keys -}}
{{- fail "auth: auth.allowAnonymous=true turns authentication off, but auth.keys holds keys: set one or the other." -}}
{{- end -}}
{{- if and .Values.rdma.enabled (ne .Values.transport "nixl") -}}
{{- fail "rdma.enabled needs transport: nixl (the RDMA devices and IPC_LOCK serve only NIXL's transfers)." -}}
{{- end -}}
{{- include "prism.checkGroupsFit" . -}}
{{- end -}}

{{/*
A replica that asks more CPUs or GPUs than a pod of its worker group has is never scheduled, and Serve waits for it
without an error: refuse to render instead. A grouped deployment asks the CPUs of every stage it holds, summed, and the
most GPUs one of them asks (PrismConfig's group sizing; an unset num_cpus is PrismConfig's default); the ingress runs
on the group that holds media, a replica of its own checked against that group's pods too (with `inIngress`, one
replica that holds the ingress and the group of every model). A pod has its container's limits (else requests), CPUs rounded up: what KubeRay
tells Ray.
*/}}
{{- define "prism.checkGroupsFit" -}}
{{- range $group := include "prism.groups" . | fromJsonArray -}}
{{- $last := last (splitList "-" $group) -}}
{{- $w := (index $.Values.stages $last).workers -}}
{{- if $w.enabled -}}
{{- $res := default dict $w.resources -}}
{{- $pod := merge (deepCopy (default dict $res.limits)) (default dict $res.requests) -}}
{{- $podCpus := include "prism.cpus" (index $pod "cpu" | default "0") | float64 | ceil -}}{{/* KubeRay: num-cpus rounded up */}}
{{- $podGpus := index $pod "nvidia.com/gpu" | default 0 | float64 -}}
{{- $replicas := list (splitList "-" $group) -}}
{{- if and $.Values.inIngress (has "media" (splitList "-" $group)) -}}{{/* the ingress replica holds the group */}}
{{- $held := list -}}{{/* (one group per model: each model's stages run in every ingress replica) */}}
{{- range until (max 1 (len $.Values.models) | int) -}}{{- $held = concat $held (splitList "-" $group) -}}{{- end -}}
{{- $replicas = list (prepend $held "ingress") -}}
{{- else if has "media" (splitList "-" $group) -}}{{- $replicas = prepend $replicas (list "ingress") -}}{{- end -}}
{{- range $stages := $replicas -}}
{{- $cpus := 0.0 -}}{{- $gpus := 0.0 -}}{{- $parts := list -}}
{{- range $stage := $stages -}}
{{- $serve := default dict (index $.Values.stages $stage).serve -}}
{{- $c := ternary $serve.num_cpus (ternary 0.1 0.25 (eq $stage "ingress")) (hasKey $serve "num_cpus") | float64 -}}
{{- $cpus = addf $cpus $c -}}
{{- $gpus = maxf $gpus ($serve.num_gpus | default 0 | float64) -}}
{{- $parts = append $parts (printf "%s %v" $stage $c) -}}
{{- end -}}
{{- if and (hasKey $pod "cpu") (gt $cpus $podCpus) -}}{{/* (no cpu given: Ray counts the node's own) */}}
{{- fail (printf "stages.%s.workers: a replica of the %s deployment asks %v CPUs (%s: serve.num_cpus) but a pod of its worker group has %v (resources): Serve would wait for it forever. Give the pod more CPUs or the stages fewer." $last (join "-" $stages) $cpus (join " + " $parts) $podCpus) -}}
{{- end -}}
{{- if gt $gpus $podGpus -}}
{{- fail (printf "stages.%s.workers: a replica of the %s deployment asks %v GPUs (serve.num_gpus) but a pod of its worker group has %v (resources nvidia.com/gpu): Serve would wait for it forever." $last (join "-" $stages) $gpus $podGpus) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* A Kubernetes CPU quantity ("8", 8, "500m") in CPUs. */}}
{{- define "prism.cpus" -}}
{{- $q := toString . -}}
{{- if hasSuffix "m" $q -}}{{- divf (trimSuffix "m" $q | float64) 1000 -}}{{- else -}}{{- $q | float64 -}}{{- end -}}
{{- end -}}

{{/* Writable directories under the read-only root filesystem. */}}
{{- define "prism.cacheDir" -}}/var/cache/prism{{- end -}}

{{- define "prism.authMountPath" -}}/etc/prism/auth{{- end -}}

{{/* The model reference Prism loads: a built-in name or a directory on the mounted volume. */}}
{{- define "prism.modelRef" -}}
{{- if eq .Values.model.source "builtin" -}}
{{- .Values.model.name -}}
{{- else -}}
{{- printf "%s/%s" (trimSuffix "/" .Values.model.mountPath) (trimPrefix "/" .Values.model.path) -}}
{{- end -}}
{{- end -}}

{{/* A `models` entry's reference: a built-in name, or a directory on the model volume. */}}
{{- define "prism.entryRef" -}}
{{- if .entry.name -}}
{{- .entry.name -}}
{{- else -}}
{{- printf "%s/%s" (trimSuffix "/" .root.Values.model.mountPath) (trimPrefix "/" .entry.path) -}}
{{- end -}}
{{- end -}}

{{/* The worker groups of the topology, in request order, each named after the stages it holds: a JSON list. */}}
{{- define "prism.groups" -}}
{{- $all := dict "E/P/D" (list "media" "encode" "prefill" "decode") "E/PD" (list "media" "encode" "prefill-decode") "EP/D" (list "media" "encode-prefill" "decode") "EPD" (list "media" "encode-prefill-decode") "ME/P/D" (list "media-encode" "prefill" "decode") "ME/PD" (list "media-encode" "prefill-decode") "MEPD" (list "media-encode-prefill-decode") -}}
{{- toJson (index $all .Values.topology) -}}
{{- end -}}

{{/* The worker group that holds a stage (argument: dict root, stage); the ingress runs on the group that holds media. */}}
{{- define "prism.groupOf" -}}
{{- $stage := ternary "media" .stage (eq .stage "ingress") -}}
{{- range $g := include "prism.groups" .root | fromJsonArray -}}
{{- if has $stage (splitList "-" $g) -}}{{- $g -}}{{- end -}}
{{- end -}}
{{- end -}}

{{/* PrismConfig (args.config of the Serve application) as YAML. */}}
{{- define "prism.config" -}}
{{- $cfg := deepCopy (default dict .Values.prism) -}}
{{- $server := deepCopy (default dict $cfg.server) -}}
{{- $_ := set $server "transport" .Values.transport -}}
{{- if include "prism.authSecret" . -}}
{{- $_ := set $server "api_keys_file" (printf "%s/%s" (include "prism.authMountPath" .) .Values.auth.secretKey) -}}
{{- end -}}
{{- $_ := set $cfg "server" $server -}}
{{- $deployments := dict -}}
{{- range $stage := list "ingress" "media" "encode" "prefill" "decode" -}}
{{- $group := include "prism.groupOf" (dict "root" $ "stage" $stage) -}}
{{- $serve := deepCopy (default dict (index $.Values.stages $stage).serve) -}}
{{- if (index $.Values.stages (last (splitList "-" $group))).workers.enabled -}}{{/* a group's: its last stage's */}}
{{- $_ := set $serve "resources" (dict (printf "prism_%s" (replace "-" "_" $group)) 1) -}}
{{- end -}}
{{- $_ := set $deployments $stage $serve -}}
{{- end -}}
{{- $_ := set $deployments "topology" .Values.topology -}}
{{- if .Values.inIngress -}}
{{- if ne .Values.topology "MEPD" -}}
{{- fail (printf "inIngress: true runs every stage of a model in the ingress replica: it needs topology MEPD, not %s." .Values.topology) -}}
{{- end -}}
{{- $_ := set $deployments "in_ingress" true -}}
{{- end -}}
{{- if .Values.models -}}
{{- $models := list -}}
{{- range $entry := .Values.models -}}
{{- $m := dict "model" (include "prism.entryRef" (dict "entry" $entry "root" $)) "dtype" (default "auto" $entry.dtype) -}}
{{- if $entry.name -}}{{- $_ := set $m "cache_dir" (printf "%s/models" (include "prism.cacheDir" $)) -}}{{- end -}}
{{- with $entry.servedName -}}{{- $_ := set $m "served_name" . -}}{{- end -}}
{{- $_ := set $m "deployments" (omit (deepCopy $deployments) "ingress") -}}
{{- $models = append $models $m -}}
{{- end -}}
{{- $_ := set $cfg "models" $models -}}
{{- $_ := set $cfg "deployments" (dict "ingress" $deployments.ingress) -}}
{{- else -}}
{{- $model := dict "model" (include "prism.modelRef" .) "dtype" .Values.model.dtype -}}
{{- if eq .Values.model.source "builtin" -}}{{/* built on first start, into the writable cache volume */}}
{{- $_ := set $model "cache_dir" (printf "%s/models" (include "prism.cacheDir" .)) -}}
{{- end -}}
{{- $_ := set $cfg "model" $model -}}
{{- $_ := set $cfg "deployments" $deployments -}}
{{- end -}}
{{- toYaml $cfg -}}
{{- end -}}

{{/*
The request-body bound in bytes: PrismConfig.body_limit (common/config.py) computed from the same values —
server.max_body_bytes, or base64 of the media request bytes + 8 bytes per text character + 1 MiB.
*/}}
{{- define "prism.bodyLimit" -}}
{{- $cfg := default dict .Values.prism -}}
{{- $server := default dict $cfg.server -}}
{{- $media := default dict $cfg.media -}}
{{- if $server.max_body_bytes -}}
{{- int64 $server.max_body_bytes -}}
{{- else -}}
{{- $perItem := int64 (default 20971520 $media.max_item_bytes) -}}
{{- $items := int64 (ternary $media.max_items_per_request 8 (hasKey $media "max_items_per_request")) -}}
{{- $bytes := min (int64 (default 67108864 $media.max_request_bytes)) (mul $items $perItem) -}}
{{- $text := int64 (default 131072 $server.max_text_chars) -}}
{{- add (mul 4 (div (add $bytes 2) 3)) (mul 8 $text) 1048576 -}}
{{- end -}}
{{- end -}}

{{/*
Environment of every Ray container: its workers start at niceness 0 (services/platform/priority.py: at Ray's 15 the
stages' own lower priority for media and the encoder barely reached the cores). Each node runs a Serve
proxy, and the proxy guards the front door before the
ingress sees a byte (services/platform/proxy_guard.py: GuardSettings.of, computed here from the same values) — body
bounds and clocks, the gRPC call cap, and the application's key file (mounted in every pod, since every pod runs a
proxy) unless authentication is off.
*/}}
{{- define "prism.proxyEnv" -}}
{{- $limit := int64 (include "prism.bodyLimit" .) -}}
{{- $server := default dict (default dict .Values.prism).server -}}
{{- $routes := list -}}
{{- if include "prism.authSecret" . -}}
{{- $file := printf "%s/%s" (include "prism.authMountPath" .) .Values.auth.secretKey -}}
{{- $routes = list (dict "app" "prism" "prefix" "/" "digests" dict "keys_file" $file "reload_s" (float64 (default 5.0 $server.api_keys_reload_s))) -}}
{{- end -}}
{{- $structure := add (mul 8 (int64 (default 256 $server.max_messages)) (int64 (default 64 $server.max_content_parts))) (int64 (default 131072 $server.max_text_chars)) 4096 -}}
{{- $guard := dict "max_body_bytes" $limit "max_json_structure" (int64 (default $structure $server.max_json_structure)) "chunked_bytes_in_flight" (int64 (default (mul 4 $limit) $server.proxy_chunked_bytes_in_flight)) "body_grace_s" (float64 (default 10.0 $server.body_read_grace_s)) "body_min_bytes_per_s" (int64 (default 65536 $server.body_min_bytes_per_s)) "retry_after_s" (float64 (default 1 $server.retry_after_s)) "grpc_max_concurrent_calls" (int64 (default 1024 $server.max_concurrent_grpc_calls)) "routes" $routes -}}
- name: RAY_worker_niceness
  value: "0"
- name: RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH
  value: services.platform.proxy_guard:middlewares
- name: PRISM_PROXY_GUARD
  value: {{ toJson $guard | quote }}
- name: PRISM_MAX_BODY_BYTES
  value: {{ $limit | quote }}
- name: RAY_SERVE_GRPC_MAX_MESSAGE_SIZE
  value: {{ add $limit 65536 | quote }}
{{- end -}}

{{/* The whole Serve config (serveConfigV2). */}}
{{- define "prism.serveConfig" -}}
proxy_location: EveryNode
http_options:
  host: 0.0.0.0
  port: {{ .Values.ports.http }}
grpc_options:
  port: {{ .Values.ports.grpc }}
  grpc_servicer_functions:
    - services.proto.prism_pb2_grpc.add_PrismServicer_to_server
applications:
  - name: prism
    route_prefix: /
    import_path: services.app:build_app
    args:
      config:
{{ include "prism.config" . | indent 8 }}
{{- end -}}

{{/* The hardened container security context; IPC_LOCK added back for NIXL over RDMA (argument: dict root, ipcLock). */}}
{{- define "prism.containerSecurityContext" -}}
{{- $ctx := deepCopy .root.Values.containerSecurityContext -}}
{{- if .ipcLock -}}
{{- $caps := deepCopy (default dict $ctx.capabilities) -}}
{{- $_ := set $caps "add" (append (default list $caps.add) "IPC_LOCK" | uniq) -}}
{{- $_ := set $ctx "capabilities" $caps -}}
{{- end -}}
{{- toYaml $ctx -}}
{{- end -}}

{{/*
One Ray pod template. Arguments (dict): root, group, container (name), resources, nodeSelector, tolerations, affinity,
env, ports (list of ContainerPort), rdma (bool: a stage whose NIXL agent may use RDMA), keys (bool: the pod mounts
the API keys — its Serve proxy checks them before it reads a body, and the ingress may run there).
*/}}
{{- define "prism.podTemplate" -}}
{{- $root := .root -}}
{{- $v := $root.Values -}}
{{- $rdma := and .rdma $v.rdma.enabled (eq $v.transport "nixl") -}}
{{- $cache := include "prism.cacheDir" $root -}}
metadata:
  labels:
    {{- include "prism.labels" $root | nindent 4 }}
    prism.io/group: {{ .group }}
spec:
  terminationGracePeriodSeconds: {{ add $v.drain.graceSeconds 30 }}
  securityContext:
    {{- toYaml $v.podSecurityContext | nindent 4 }}
  {{- with $v.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
    - name: {{ .container }}
      image: {{ include "prism.image" $root }}
      imagePullPolicy: {{ $v.image.pullPolicy }}
      workingDir: /app
      securityContext:
        {{- include "prism.containerSecurityContext" (dict "root" $root "ipcLock" $rdma) | nindent 8 }}
      ports:
        - {name: metrics, containerPort: {{ $v.ports.metrics }}, protocol: TCP}
        {{- range .ports }}
        - {{ toJson . }}
        {{- end }}
      {{- /* the root filesystem is read-only: HOME (Prism's ~/.cache/prism: model contracts, models built from a
      name) and the libraries' caches point into the writable cache volume */}}
      {{- $writable := list (dict "name" "HOME" "value" $cache) (dict "name" "XDG_CACHE_HOME" "value" (printf "%s/.cache" $cache)) (dict "name" "HF_HOME" "value" (printf "%s/huggingface" $cache)) (dict "name" "TRITON_CACHE_DIR" "value" (printf "%s/triton" $cache)) (dict "name" "PYTHONDONTWRITEBYTECODE" "value" "1") }}
      {{- $env := concat (fromYamlArray (include "prism.proxyEnv" $root)) $writable (default list $v.env) (default list .env) }}
      {{- if $rdma }}{{/* UCX's RDMA transports only where the devices are; otherwise UCX picks its own (TCP) */}}
      {{- $env = append $env (dict "name" "UCX_TLS" "value" $v.rdma.ucx.tls) }}
      {{- if $v.rdma.ucx.netDevices }}
      {{- $env = append $env (dict "name" "UCX_NET_DEVICES" "value" $v.rdma.ucx.netDevices) }}
      {{- end }}
      {{- end }}
      env:
        {{- toYaml $env | nindent 8 }}
      {{- $res := deepCopy (default dict .resources) }}
      {{- if $rdma }}
      {{- $limits := default dict $res.limits }}
      {{- $_ := set $limits $v.rdma.resourceName $v.rdma.count }}
      {{- $_ := set $res "limits" $limits }}
      {{- $requests := default dict $res.requests }}
      {{- $_ := set $requests $v.rdma.resourceName $v.rdma.count }}
      {{- $_ := set $res "requests" $requests }}
      {{- end }}
      resources:
        {{- toYaml $res | nindent 8 }}
      {{- /* a worker drains its Ray node first — no new work; Serve replaces its replicas elsewhere and stops them
      here (a decode stream of a stopped replica migrates) — then stops Ray (services/platform/drain.py); the head,
      which runs no replica, stops at once */}}
      lifecycle:
        preStop:
          exec:
            {{- if eq .group "head" }}
            command: ["/bin/sh", "-c", "ray stop"]
            {{- else }}
            command: ["python", "-m", "services.platform.drain", "--grace-s", {{ $v.drain.graceSeconds | quote }}]
            {{- end }}
      volumeMounts:
        - {name: shm, mountPath: /dev/shm}
        - {name: tmp, mountPath: /tmp}
        - {name: cache, mountPath: {{ $cache }}}
        {{- if ne $v.model.source "builtin" }}
        - {name: model, mountPath: {{ $v.model.mountPath | quote }}, readOnly: true}
        {{- end }}
        {{- if and .keys (include "prism.authSecret" $root) }}
        - {name: api-keys, mountPath: {{ include "prism.authMountPath" $root | quote }}, readOnly: true}
        {{- end }}
  volumes:
    - name: shm
      emptyDir: {medium: Memory, sizeLimit: {{ $v.shmSize | quote }}}
    - name: tmp
      emptyDir: {sizeLimit: {{ $v.writable.tmpSize | quote }}}
    - name: cache
      emptyDir: {sizeLimit: {{ $v.writable.cacheSize | quote }}}
    {{- if eq $v.model.source "pvc" }}
    - name: model
      persistentVolumeClaim: {claimName: {{ $v.model.claimName | quote }}, readOnly: true}
    {{- else if eq $v.model.source "hostPath" }}
    - name: model
      hostPath: {path: {{ $v.model.hostPath | quote }}, type: Directory}
    {{- end }}
    {{- if .keys }}
    {{- with include "prism.authSecret" $root }}
    - name: api-keys
      secret: {secretName: {{ . | quote }}}
    {{- end }}
    {{- end }}
  {{- with .nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end -}}
