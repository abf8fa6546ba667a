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

{{/* The API-key Secret's name, or "" when authentication is off. */}}
{{- define "prism.authSecret" -}}
{{- if .Values.auth.existingSecret -}}
{{- .Values.auth.existingSecret -}}
{{- else if .Values.auth.keys -}}
{{- printf "%s-api-keys" (include "prism.fullname" .) -}}
{{- end -}}
{{- end -}}

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
{{- $group := ternary "media" $stage (eq $stage "ingress") -}}{{/* the ingress runs on the CPU (media) workers */}}
{{- $serve := deepCopy (default dict (index $.Values.stages $stage).serve) -}}
{{- if (index $.Values.stages $group).workers.enabled -}}
{{- $_ := set $serve "resources" (dict (printf "prism_%s" $group) 1) -}}
{{- end -}}
{{- $_ := set $deployments $stage $serve -}}
{{- end -}}
{{- if .Values.models -}}
{{- $models := list -}}
{{- range $entry := .Values.models -}}
{{- $m := dict "model" (include "prism.entryRef" (dict "entry" $entry "root" $)) "dtype" (default "auto" $entry.dtype) -}}
{{- with $entry.servedName -}}{{- $_ := set $m "served_name" . -}}{{- end -}}
{{- $_ := set $m "deployments" (omit (deepCopy $deployments) "ingress") -}}
{{- $models = append $models $m -}}
{{- end -}}
{{- $_ := set $cfg "models" $models -}}
{{- $_ := set $cfg "deployments" (dict "ingress" $deployments.ingress) -}}
{{- else -}}
{{- $_ := set $cfg "model" (dict "model" (include "prism.modelRef" .) "dtype" .Values.model.dtype) -}}
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
Environment of every Ray container: each node runs a Serve proxy, and the proxy bounds request bodies before the
ingress sees a byte (services/proxy_guard.py); gRPC messages are bounded by Serve itself.
*/}}
{{- define "prism.proxyEnv" -}}
{{- $limit := include "prism.bodyLimit" . -}}
- name: RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH
  value: services.proxy_guard:middlewares
- name: PRISM_MAX_BODY_BYTES
  value: {{ $limit | quote }}
- name: RAY_SERVE_GRPC_MAX_MESSAGE_SIZE
  value: {{ add (int64 $limit) 65536 | quote }}
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

{{/*
One Ray pod template. Arguments (dict): root, container (name), resources, nodeSelector, tolerations, affinity, env,
ports (list of ContainerPort), rdma (bool).
*/}}
{{- define "prism.podTemplate" -}}
{{- $root := .root -}}
{{- $v := $root.Values -}}
metadata:
  labels:
    {{- include "prism.labels" $root | nindent 4 }}
    prism.io/group: {{ .group }}
spec:
  {{- with $v.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
    - name: {{ .container }}
      image: {{ include "prism.image" $root }}
      imagePullPolicy: {{ $v.image.pullPolicy }}
      workingDir: /app
      ports:
        - {name: metrics, containerPort: {{ $v.ports.metrics }}, protocol: TCP}
        {{- range .ports }}
        - {{ toJson . }}
        {{- end }}
      {{- $env := concat (fromYamlArray (include "prism.proxyEnv" $root)) (default list $v.env) (default list .env) }}
      {{- if and .rdma (eq $v.transport "nixl") }}
      {{- $env = append $env (dict "name" "UCX_TLS" "value" $v.rdma.ucx.tls) }}
      {{- if $v.rdma.ucx.netDevices }}
      {{- $env = append $env (dict "name" "UCX_NET_DEVICES" "value" $v.rdma.ucx.netDevices) }}
      {{- end }}
      {{- end }}
      {{- with $env }}
      env:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- $res := deepCopy (default dict .resources) }}
      {{- if and .rdma $v.rdma.enabled }}
      {{- $limits := default dict $res.limits }}
      {{- $_ := set $limits $v.rdma.resourceName $v.rdma.count }}
      {{- $_ := set $res "limits" $limits }}
      {{- $requests := default dict $res.requests }}
      {{- $_ := set $requests $v.rdma.resourceName $v.rdma.count }}
      {{- $_ := set $res "requests" $requests }}
      {{- end }}
      resources:
        {{- toYaml $res | nindent 8 }}
      {{- if and .rdma $v.rdma.enabled }}
      securityContext:
        capabilities:
          add: [IPC_LOCK]
      {{- end }}
      lifecycle:
        preStop:
          exec:
            command: ["/bin/sh", "-c", "ray stop"]
      volumeMounts:
        - {name: shm, mountPath: /dev/shm}
        {{- if ne $v.model.source "builtin" }}
        - {name: model, mountPath: {{ $v.model.mountPath | quote }}, readOnly: true}
        {{- end }}
        {{- if include "prism.authSecret" $root }}
        - {name: api-keys, mountPath: {{ include "prism.authMountPath" $root | quote }}, readOnly: true}
        {{- end }}
  volumes:
    - name: shm
      emptyDir: {medium: Memory, sizeLimit: {{ $v.shmSize | quote }}}
    {{- if eq $v.model.source "pvc" }}
    - name: model
      persistentVolumeClaim: {claimName: {{ $v.model.claimName | quote }}, readOnly: true}
    {{- else if eq $v.model.source "hostPath" }}
    - name: model
      hostPath: {path: {{ $v.model.hostPath | quote }}, type: Directory}
    {{- end }}
    {{- with include "prism.authSecret" $root }}
    - name: api-keys
      secret: {secretName: {{ . | quote }}}
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
